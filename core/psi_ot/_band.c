/* Inner loops of the VOLE-based PSI that numpy cannot vectorise (see core/psi_ot/native.py):
 * the banded OKVS's elimination and back-substitution, its decoding, the sparse gather-XOR
 * of the expand-accumulate code, and GF(2^128) products by one constant from byte tables.
 * Elements are 128-bit values as two uint64 words (low first); a band is 128 bits, bit k for
 * column start + k. Each function does exactly what its numpy/Python twin in
 * core/psi_ot/okvs.py, vole.py or gf128.py does, so both give the same bytes. The GIL is
 * released around every loop. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint64_t lo, hi;
} u128;

static inline int ctz128(u128 b) {
    if (b.lo) return __builtin_ctzll(b.lo);
    return 64 + __builtin_ctzll(b.hi);
}

static inline u128 shr128(u128 b, int64_t d) {
    u128 r;
    if (d == 0) return b;
    if (d >= 128) { r.lo = r.hi = 0; return r; }
    if (d >= 64) { r.lo = b.hi >> (d - 64); r.hi = 0; return r; }
    r.lo = (b.lo >> d) | (b.hi << (64 - d));
    r.hi = b.hi >> d;
    return r;
}

static inline int bit128(u128 b, int64_t k) {
    return k < 64 ? (int)((b.lo >> k) & 1) : (int)((b.hi >> (k - 64)) & 1);
}

/* encode(starts int64[n] sorted, bands u128[n], values u128[n], table u128[m] prefilled
 * with the free columns' values, w) -> bool. bands and values are overwritten. */
static PyObject *encode(PyObject *self, PyObject *args) {
    Py_buffer starts_b, bands_b, values_b, table_b;
    if (!PyArg_ParseTuple(args, "y*w*w*w*", &starts_b, &bands_b, &values_b, &table_b))
        return NULL;
    const int64_t *starts = starts_b.buf;
    u128 *bands = bands_b.buf, *values = values_b.buf, *table = table_b.buf;
    Py_ssize_t n = starts_b.len / 8, m = table_b.len / 16;
    int ok = 1;
    int64_t *pivots = PyMem_RawMalloc((n ? n : 1) * sizeof(int64_t));
    if (!pivots) {
        PyBuffer_Release(&starts_b); PyBuffer_Release(&bands_b);
        PyBuffer_Release(&values_b); PyBuffer_Release(&table_b);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        u128 b = bands[i];
        if (!b.lo && !b.hi) { ok = 0; break; }
        int64_t p = starts[i] + ctz128(b);
        if (p >= m) { ok = 0; break; }
        pivots[i] = p;
        for (Py_ssize_t j = i + 1; j < n && starts[j] <= p; j++) {
            if (bit128(bands[j], p - starts[j])) {
                u128 s = shr128(b, starts[j] - starts[i]);
                bands[j].lo ^= s.lo; bands[j].hi ^= s.hi;
                values[j].lo ^= values[i].lo; values[j].hi ^= values[i].hi;
            }
        }
    }
    if (ok) {
        for (Py_ssize_t i = n - 1; i >= 0; i--) {
            u128 acc = values[i], b = bands[i];
            int64_t p = pivots[i];
            int first = ctz128(b);
            /* clear the pivot bit, then add every other column of the row */
            if (first < 64) b.lo &= ~(1ULL << first); else b.hi &= ~(1ULL << (first - 64));
            while (b.lo) {
                int k = __builtin_ctzll(b.lo);
                b.lo &= b.lo - 1;
                acc.lo ^= table[starts[i] + k].lo; acc.hi ^= table[starts[i] + k].hi;
            }
            while (b.hi) {
                int k = 64 + __builtin_ctzll(b.hi);
                b.hi &= b.hi - 1;
                acc.lo ^= table[starts[i] + k].lo; acc.hi ^= table[starts[i] + k].hi;
            }
            table[p] = acc;
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_RawFree(pivots);
    PyBuffer_Release(&starts_b); PyBuffer_Release(&bands_b);
    PyBuffer_Release(&values_b); PyBuffer_Release(&table_b);
    return PyBool_FromLong(ok);
}

/* decode(table u128[m], starts int64[n], bands u128[n], out u128[n]) */
static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer table_b, starts_b, bands_b, out_b;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &table_b, &starts_b, &bands_b, &out_b))
        return NULL;
    const u128 *table = table_b.buf, *bands = bands_b.buf;
    const int64_t *starts = starts_b.buf;
    u128 *out = out_b.buf;
    Py_ssize_t n = starts_b.len / 8;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const u128 *row = table + starts[i];
        uint64_t lo = 0, hi = 0, w = bands[i].lo;
        while (w) {
            int k = __builtin_ctzll(w);
            w &= w - 1;
            lo ^= row[k].lo; hi ^= row[k].hi;
        }
        w = bands[i].hi;
        while (w) {
            int k = 64 + __builtin_ctzll(w);
            w &= w - 1;
            lo ^= row[k].lo; hi ^= row[k].hi;
        }
        out[i].lo = lo; out[i].hi = hi;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&table_b); PyBuffer_Release(&starts_b);
    PyBuffer_Release(&bands_b); PyBuffer_Release(&out_b);
    Py_RETURN_NONE;
}

/* gather_xor(source u128[N], draws uint32[m * w], out u128[m], w): out[i] = xor of
 * source[(draws[i * w + k] * N) >> 32] over k (a draw scaled to [0, N)). */
static PyObject *gather_xor(PyObject *self, PyObject *args) {
    Py_buffer source_b, draws_b, out_b;
    Py_ssize_t w;
    if (!PyArg_ParseTuple(args, "y*y*w*n", &source_b, &draws_b, &out_b, &w)) return NULL;
    const u128 *source = source_b.buf;
    const uint32_t *draws = draws_b.buf;
    u128 *out = out_b.buf;
    Py_ssize_t m = out_b.len / 16;
    uint64_t length = (uint64_t)(source_b.len / 16);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < m; i++) {
        uint64_t lo = 0, hi = 0;
        for (Py_ssize_t k = 0; k < w; k++) {
            const u128 *s = source + (((uint64_t)draws[i * w + k] * length) >> 32);
            lo ^= s->lo; hi ^= s->hi;
        }
        out[i].lo = lo; out[i].hi = hi;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&source_b); PyBuffer_Release(&draws_b); PyBuffer_Release(&out_b);
    Py_RETURN_NONE;
}

/* mul_tables(tables u128[16 * 256], values u128[n], out u128[n]): out[i] = xor over byte
 * positions j of tables[j][byte j of values[i]], a product by the tables' constant. */
static PyObject *mul_tables(PyObject *self, PyObject *args) {
    Py_buffer tables_b, values_b, out_b;
    if (!PyArg_ParseTuple(args, "y*y*w*", &tables_b, &values_b, &out_b)) return NULL;
    const u128 *tables = tables_b.buf;
    const uint8_t *values = values_b.buf;
    u128 *out = out_b.buf;
    Py_ssize_t n = out_b.len / 16;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t lo = 0, hi = 0;
        for (int j = 0; j < 16; j++) {
            const u128 *t = tables + 256 * j + values[16 * i + j];
            lo ^= t->lo; hi ^= t->hi;
        }
        out[i].lo = lo; out[i].hi = hi;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&tables_b); PyBuffer_Release(&values_b); PyBuffer_Release(&out_b);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS, "Banded OKVS elimination and back-substitution."},
    {"decode", decode, METH_VARARGS, "Banded OKVS decoding."},
    {"gather_xor", gather_xor, METH_VARARGS, "XOR of w gathered 128-bit values per output."},
    {"mul_tables", mul_tables, METH_VARARGS, "GF(2^128) products by one constant's tables."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_band", NULL, -1, methods};

PyMODINIT_FUNC PyInit__band(void) { return PyModule_Create(&module); }
