/*
 * Montgomery arithmetic modulo an arbitrary odd modulus, for Paillier's hot loops.
 *
 * Why this exists: X^T [[d]] and fixed-base encryption are long chains of multiplications
 * modulo n^2. Done from Python with gmpy2, every step allocates an mpz and reduces with a
 * full division; here a whole chain runs in C on Montgomery residues, with the GIL released.
 *
 * Two products: AVX2 code in radix 2^26 (vec_mul), used where the x86-64 CPU has AVX2 (checked
 * at import; compiled through a target attribute, so the build needs no -march flag), and a
 * portable one (Karatsuba product, product-scanning reduction) everywhere else.
 *
 * Interface (see core/paillier/native.py): numbers travel as little-endian byte strings of
 * exactly 8 * limbs bytes (limbs = 64-bit words of the modulus); exponents and digits as
 * C-contiguous int64 buffers (numpy arrays). Every length and value is checked before any
 * work starts; bad input raises ValueError.
 *
 * Security note: bucket indices and table lookups depend on the (secret) digits, and the final
 * subtraction of a Montgomery product is conditional, as in the gmpy2 code this replaces. So
 * nothing here is constant-time: an observer of this machine's caches or timing (a local,
 * co-resident process) could learn about exponents. Nothing leaks over the network beyond the
 * total running time, which the gmpy2 path shows as well.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint64_t limb;
typedef unsigned __int128 dlimb;

/* 16384-bit moduli: n^2 of an 8192-bit key. Bounds the stack scratch of one product. */
#define MAX_LIMBS 256
#define MAX_WINDOW 18
/*
 * Vector loads are fastest from 32-byte aligned addresses: residue arrays of the vector path
 * are aligned (heap blocks through aligned_block; every residue is a multiple of 4 words).
 */
#if defined(__GNUC__) || defined(__clang__)
#define ALIGNED __attribute__((aligned(32)))
#else
#define ALIGNED
#endif

static void *aligned_block(size_t size)
{
#if defined(_WIN32)
    return PyMem_RawCalloc(1, size); /* the vector path is not compiled there */
#else
    void *p = NULL;
    if (posix_memalign(&p, 64, size ? size : 1) != 0)
        return NULL;
    memset(p, 0, size);
    return p;
#endif
}

static void aligned_free(void *p)
{
#if defined(_WIN32)
    PyMem_RawFree(p);
#else
    free(p);
#endif
}

/* the vector path's residues: 26-bit limbs in 64-bit lanes, padded (see vec_mul) */
#define RADIX 26
#define RADIX_MASK ((((limb)1) << RADIX) - 1)
#define MAX_WORDS (((MAX_LIMBS * 64 + RADIX - 1) / RADIX + 3) / 4 * 4 + 4)

/*
 * A modulus and its Montgomery constants. Residues live in one of two working
 * representations, fixed per context: 64-bit limbs (``s`` words, the portable scalar path)
 * or 26-bit limbs in 64-bit lanes (``w`` words, the AVX2 path where the CPU has it). ``w`` is
 * the size of every working residue buffer; R is 2^(64 s) or 2^(26 n26) accordingly.
 */
typedef struct {
    Py_ssize_t s; /* 64-bit limbs of m */
    limb m[MAX_LIMBS];
    limb minv; /* -m^-1 mod 2^64 */
    int vec;   /* working representation: radix 2^26 for vec_mul */
    Py_ssize_t n26; /* 26-bit limbs of m (vec) */
    Py_ssize_t w;   /* words per working residue: s, or n26 rounded up to 4 plus 4 zeros */
    limb m26[MAX_WORDS] ALIGNED;
    limb m26_shifted[MAX_WORDS] ALIGNED; /* m26 one lane up (lane 0 zero) */
    limb minv26;                 /* -m^-1 mod 2^26 */
    limb one[MAX_WORDS];         /* R mod m: 1 in Montgomery form */
    limb r2[MAX_WORDS];          /* R^2 mod m: converts into Montgomery form */
    limb unit[MAX_WORDS];        /* the integer 1: converts out of Montgomery form */
} mont_ctx;

/* whether new contexts use the vector path (set at import from the CPU's features) */
static int use_vector = 0;

/* ---------------------------------------------------------------- multiplication */

/*
 * The portable product. Why this shape: on the x86-64 machines measured (gcc -O3, no asm) the 64x64->128-bit
 * multiplier is the bottleneck, about two cycles per word product, so the only lever left is
 * the number of word products. A multiplication is therefore a Karatsuba product (3/4 of the
 * word products per level, down to KARATSUBA_THRESHOLD limbs; 0.84 of the schoolbook time at
 * 32 limbs and 0.8 at 64) followed by a separate product-scanning Montgomery reduction
 * (s^2 word products). Measured against the interleaved (FIPS) and CIOS Montgomery
 * multiplications at 16, 32, 48 and 64 limbs: never slower, 13-20% faster from 32 limbs.
 * Squaring sums each off-diagonal product once and doubles it.
 */
#define KARATSUBA_THRESHOLD 24

/* acc (two words) + top (third word): a column sum of word products without carry loss */
#define MAC(x, y)                                                                      \
    do {                                                                               \
        dlimb p_ = (dlimb)(x) * (y);                                                   \
        acc += p_;                                                                     \
        top += acc < p_;                                                               \
    } while (0)

/* shift the accumulator one word down after a column is done */
#define NEXT_COLUMN()                                                                  \
    do {                                                                               \
        acc = (acc >> 64) | ((dlimb)top << 64);                                        \
        top = 0;                                                                       \
    } while (0)

static void final_subtract(limb *r, const limb *t, limb carry, const mont_ctx *c)
{
    const Py_ssize_t s = c->s;
    limb d[MAX_LIMBS];
    limb borrow = 0;
    for (Py_ssize_t j = 0; j < s; j++) {
        dlimb x = (dlimb)t[j] - c->m[j] - borrow;
        d[j] = (limb)x;
        borrow = (limb)(x >> 64) & 1;
    }
    /* t + carry * R >= m exactly when there is a carry or the subtraction did not borrow */
    memmove(r, (carry || !borrow) ? d : t, (size_t)s * sizeof(limb));
}

/* r[0, 2n) = a * b, column by column (product scanning) */
static void mul_basecase(limb *r, const limb *a, const limb *b, Py_ssize_t n)
{
    dlimb acc = 0;
    limb top = 0;
    for (Py_ssize_t k = 0; k < 2 * n - 1; k++) {
        const Py_ssize_t lo = k < n ? 0 : k - n + 1, hi = k < n ? k : n - 1;
        for (Py_ssize_t i = lo; i <= hi; i++)
            MAC(a[i], b[k - i]);
        r[k] = (limb)acc;
        NEXT_COLUMN();
    }
    r[2 * n - 1] = (limb)acc;
}

/* r[0, 2n) = a^2: off-diagonal products once, doubled, plus the diagonal */
static void sqr_basecase(limb *r, const limb *a, Py_ssize_t n)
{
    dlimb acc = 0;
    limb top = 0;
    for (Py_ssize_t k = 0; k < 2 * n - 1; k++) {
        const Py_ssize_t lo = k < n ? 0 : k - n + 1;
        dlimb carried = acc;
        limb carried_top = top;
        acc = 0;
        top = 0;
        for (Py_ssize_t i = lo; i < k - i; i++)
            MAC(a[i], a[k - i]);
        /* the off-diagonal sum is below n * 2^127, so doubling fits the three words */
        top = (top << 1) | (limb)(acc >> 127);
        acc <<= 1;
        acc += carried;
        top += carried_top + (acc < carried);
        if ((k & 1) == 0)
            MAC(a[k / 2], a[k / 2]);
        r[k] = (limb)acc;
        NEXT_COLUMN();
    }
    r[2 * n - 1] = (limb)acc;
}

static limb add_n(limb *r, const limb *a, const limb *b, Py_ssize_t n)
{
    limb carry = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        dlimb x = (dlimb)a[i] + b[i] + carry;
        r[i] = (limb)x;
        carry = (limb)(x >> 64);
    }
    return carry;
}

static limb sub_n(limb *r, const limb *a, const limb *b, Py_ssize_t n)
{
    limb borrow = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        dlimb x = (dlimb)a[i] - b[i] - borrow;
        r[i] = (limb)x;
        borrow = (limb)(x >> 64) & 1;
    }
    return borrow;
}

/* r[0, h) = |a - b| for a of h limbs and b of l <= h limbs; 1 when a < b */
static int abs_diff(limb *r, const limb *a, Py_ssize_t h, const limb *b, Py_ssize_t l)
{
    limb wide[MAX_LIMBS];
    memcpy(wide, b, (size_t)l * sizeof(limb));
    memset(wide + l, 0, (size_t)(h - l) * sizeof(limb));
    Py_ssize_t i = h - 1;
    while (i >= 0 && a[i] == wide[i])
        i--;
    if (i < 0 || a[i] > wide[i]) {
        sub_n(r, a, wide, h);
        return 0;
    }
    sub_n(r, wide, a, h);
    return 1;
}

/*
 * r[0, 2n) = a * b (a * a when square), Karatsuba in its subtractive form:
 * a0 b1 + a1 b0 = a0 b0 + a1 b1 - (a0 - a1)(b0 - b1), so no operand grows a carry limb.
 * The halves are h = ceil(n/2) and l = n - h limbs (odd sizes allowed). Scratch lives on
 * the stack: a few MAX_LIMBS arrays per level, at most log2(MAX_LIMBS / 12) levels.
 */
static void product(limb *r, const limb *a, const limb *b, Py_ssize_t n, int square)
{
    if (n < KARATSUBA_THRESHOLD) {
        if (square)
            sqr_basecase(r, a, n);
        else
            mul_basecase(r, a, b, n);
        return;
    }
    const Py_ssize_t h = (n + 1) / 2, l = n - h;
    limb da[MAX_LIMBS], db[MAX_LIMBS], p[2 * MAX_LIMBS], t[2 * MAX_LIMBS + 1];
    product(r, a, b, h, square);                 /* a0 b0 -> r[0, 2h) */
    product(r + 2 * h, a + h, b + h, l, square); /* a1 b1 -> r[2h, 2n) */
    int negative = abs_diff(da, a, h, a + h, l);
    if (square)
        negative = 0; /* (a0 - a1)^2 is subtracted either way */
    else
        negative ^= abs_diff(db, b, h, b + h, l);
    product(p, da, square ? da : db, h, square);
    /* t = a0 b0 + a1 b1 - (a0 - a1)(b0 - b1), in 2h + 1 limbs (it is >= 0) */
    limb high[2 * MAX_LIMBS];
    memcpy(high, r + 2 * h, (size_t)(2 * l) * sizeof(limb));
    memset(high + 2 * l, 0, (size_t)(2 * h - 2 * l) * sizeof(limb));
    t[2 * h] = add_n(t, r, high, 2 * h);
    if (negative)
        t[2 * h] += add_n(t, t, p, 2 * h);
    else
        t[2 * h] -= sub_n(t, t, p, 2 * h);
    /* r[h, 2n) += t; the total a * b fits 2n limbs, so the carry dies inside */
    const Py_ssize_t span = 2 * h + 1 <= 2 * n - h ? 2 * h + 1 : 2 * n - h;
    limb carry = add_n(r + h, r + h, t, span);
    for (Py_ssize_t i = h + span; carry && i < 2 * n; i++) {
        r[i] += carry;
        carry = r[i] == 0;
    }
}

/* (T + q m) / R for T < m^2 (2s limbs), product scanning; result below m */
static void redc(limb *r, const limb *T, const mont_ctx *c)
{
    const Py_ssize_t s = c->s;
    const limb *m = c->m;
    limb q[MAX_LIMBS], t[MAX_LIMBS];
    dlimb acc = 0;
    limb top = 0;
    for (Py_ssize_t k = 0; k < s; k++) {
        for (Py_ssize_t i = 0; i < k; i++)
            MAC(q[i], m[k - i]);
        acc += T[k];
        top += acc < T[k];
        q[k] = (limb)acc * c->minv;
        MAC(q[k], m[0]); /* clears the low word by construction */
        NEXT_COLUMN();
    }
    for (Py_ssize_t k = s; k < 2 * s - 1; k++) {
        for (Py_ssize_t i = k - s + 1; i < s; i++)
            MAC(q[i], m[k - i]);
        acc += T[k];
        top += acc < T[k];
        t[k - s] = (limb)acc;
        NEXT_COLUMN();
    }
    acc += T[2 * s - 1];
    t[s - 1] = (limb)acc;
    final_subtract(r, t, (limb)(acc >> 64), c);
}

/* Montgomery product a b / R mod m; inputs below m; r may alias a or b */
static void mont_mul64(limb *r, const limb *a, const limb *b, const mont_ctx *c)
{
    limb T[2 * MAX_LIMBS];
    product(T, a, b, c->s, 0);
    redc(r, T, c);
}

static void mont_sqr64(limb *r, const limb *a, const mont_ctx *c)
{
    limb T[2 * MAX_LIMBS];
    product(T, a, a, c->s, 1);
    redc(r, T, c);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_VECTOR 1
#include <immintrin.h>

/*
 * Montgomery product in radix 2^26 with AVX2 (x86-64 only, chosen at run time when the CPU
 * has it; compiled with a target attribute, so the build needs no -march flag). Why: the
 * scalar path is bound by the 64x64-bit multiplier, while one vpmuludq does four 32x32-bit
 * products; with 26-bit limbs a lane can sum thousands of 52-bit products without carry
 * handling, so the inner loop is only multiply-add. Operand scanning, two rows (a[i] and
 * a[i+1], with their Montgomery digits q) per pass over the accumulator, which halves its
 * loads and stores; both q are computed from scalars, so no lane waits on a vector store.
 * Bounds: lanes stay below 2 * n26 * 2^52 + 2^38 < 2^63 for n26 <= 640. Inputs below m
 * (limbs below 2^26, lanes from n26 on zero), output likewise; r may alias a or b.
 */
__attribute__((target("avx2"))) static void vec_mul(limb *r, const limb *a, const limb *b,
                                                    const mont_ctx *c)
{
    const Py_ssize_t n = c->n26, w = c->w;
    const limb *m = c->m26, *m1 = c->m26_shifted, minv = c->minv26;
    /* 32-byte alignment keeps most vector accesses within one cache line */
    limb T[2 * MAX_WORDS + 8] ALIGNED;
    limb b1[MAX_WORDS] ALIGNED;
    limb out[MAX_WORDS + 1], d[MAX_WORDS];
    memset(T, 0, sizeof(limb) * (size_t)(n + w + 8));
    b1[0] = 0;
    memcpy(b1 + 1, b, sizeof(limb) * (size_t)(w - 1));
    Py_ssize_t i = 0;
    for (; i + 1 < n; i += 2) {
        const limb t0 = T[i] + a[i] * b[0];
        const limb q0 = (t0 * minv) & RADIX_MASK;
        const limb t1 = T[i + 1] + a[i] * b[1] + q0 * m[1] + a[i + 1] * b[0] +
                        ((t0 + q0 * m[0]) >> RADIX);
        const limb q1 = (t1 * minv) & RADIX_MASK;
        const __m256i a0v = _mm256_set1_epi64x((long long)a[i]);
        const __m256i q0v = _mm256_set1_epi64x((long long)q0);
        const __m256i a1v = _mm256_set1_epi64x((long long)a[i + 1]);
        const __m256i q1v = _mm256_set1_epi64x((long long)q1);
        for (Py_ssize_t j = 0; j < w; j += 4) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(T + i + j));
            __m256i p0 = _mm256_add_epi64(
                _mm256_mul_epu32(a0v, _mm256_loadu_si256((const __m256i *)(b + j))),
                _mm256_mul_epu32(q0v, _mm256_loadu_si256((const __m256i *)(m + j))));
            __m256i p1 = _mm256_add_epi64(
                _mm256_mul_epu32(a1v, _mm256_loadu_si256((const __m256i *)(b1 + j))),
                _mm256_mul_epu32(q1v, _mm256_loadu_si256((const __m256i *)(m1 + j))));
            _mm256_storeu_si256((__m256i *)(T + i + j),
                                _mm256_add_epi64(x, _mm256_add_epi64(p0, p1)));
        }
        T[i + 1] += T[i] >> RADIX;
        T[i + 2] += T[i + 1] >> RADIX;
    }
    for (; i < n; i++) { /* the last row when n is odd */
        const limb q = ((T[i] + a[i] * b[0]) * minv) & RADIX_MASK;
        const __m256i av = _mm256_set1_epi64x((long long)a[i]);
        const __m256i qv = _mm256_set1_epi64x((long long)q);
        for (Py_ssize_t j = 0; j < w; j += 4) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(T + i + j));
            x = _mm256_add_epi64(
                x, _mm256_mul_epu32(av, _mm256_loadu_si256((const __m256i *)(b + j))));
            x = _mm256_add_epi64(
                x, _mm256_mul_epu32(qv, _mm256_loadu_si256((const __m256i *)(m + j))));
            _mm256_storeu_si256((__m256i *)(T + i + j), x);
        }
        T[i + 1] += T[i] >> RADIX;
    }
    /* (T / R) in normalised limbs: below 2m */
    limb carry = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        limb v = T[n + k] + carry;
        out[k] = v & RADIX_MASK;
        carry = v >> RADIX;
    }
    out[n] = carry;
    int64_t borrow = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t v = (int64_t)out[k] - (int64_t)m[k] + borrow;
        d[k] = (limb)v & RADIX_MASK;
        borrow = v >> RADIX; /* 0 or -1 */
    }
    memcpy(r, (out[n] || !borrow) ? d : out, sizeof(limb) * (size_t)n);
    memset(r + n, 0, sizeof(limb) * (size_t)(w - n));
}
#else
#define HAVE_VECTOR 0
#endif

static void mont_mul(limb *r, const limb *a, const limb *b, const mont_ctx *c)
{
#if HAVE_VECTOR
    if (c->vec) {
        vec_mul(r, a, b, c);
        return;
    }
#endif
    mont_mul64(r, a, b, c);
}

static void mont_sqr(limb *r, const limb *a, const mont_ctx *c)
{
#if HAVE_VECTOR
    if (c->vec) {
        vec_mul(r, a, a, c);
        return;
    }
#endif
    mont_sqr64(r, a, c);
}

/* ---------------------------------------------------------------- context and conversions */

/* a < m ? */
static int below(const limb *a, const limb *m, Py_ssize_t s)
{
    for (Py_ssize_t j = s - 1; j >= 0; j--)
        if (a[j] != m[j])
            return a[j] < m[j];
    return 0;
}

/* (a * 2) mod m for a < m */
static void double_mod(limb *a, const mont_ctx *c)
{
    limb top = a[c->s - 1] >> 63;
    for (Py_ssize_t j = c->s - 1; j > 0; j--)
        a[j] = (a[j] << 1) | (a[j - 1] >> 63);
    a[0] <<= 1;
    final_subtract(a, a, top, c);
}

static void load_limbs(limb *out, const unsigned char *bytes, Py_ssize_t s)
{
    for (Py_ssize_t j = 0; j < s; j++) {
        limb w = 0;
        for (int b = 7; b >= 0; b--)
            w = (w << 8) | bytes[8 * j + b];
        out[j] = w;
    }
}

static void store_limbs(unsigned char *bytes, const limb *in, Py_ssize_t s)
{
    for (Py_ssize_t j = 0; j < s; j++)
        for (int b = 0; b < 8; b++)
            bytes[8 * j + b] = (unsigned char)(in[j] >> (8 * b));
}

/* 64-bit limbs (s words) to the vector representation (w words, zero padded) */
static void to_radix26(limb *dst, const limb *src, const mont_ctx *c)
{
    for (Py_ssize_t k = 0; k < c->n26; k++) {
        const Py_ssize_t bit = k * RADIX, word = bit >> 6;
        const int offset = (int)(bit & 63);
        limb v = src[word] >> offset;
        if (offset > 64 - RADIX && word + 1 < c->s)
            v |= src[word + 1] << (64 - offset);
        dst[k] = v & RADIX_MASK;
    }
    memset(dst + c->n26, 0, sizeof(limb) * (size_t)(c->w - c->n26));
}

/* the vector representation (a value below m) back to 64-bit limbs (s words) */
static void from_radix26(limb *dst, const limb *src, const mont_ctx *c)
{
    memset(dst, 0, sizeof(limb) * (size_t)c->s);
    for (Py_ssize_t k = 0; k < c->n26; k++) {
        const Py_ssize_t bit = k * RADIX, word = bit >> 6;
        const int offset = (int)(bit & 63);
        dst[word] |= src[k] << offset;
        if (offset > 64 - RADIX && word + 1 < c->s)
            dst[word + 1] |= src[k] >> (64 - offset);
    }
}

/* working representation <-> 64-bit limbs */
static void to_working(limb *dst, const limb *src64, const mont_ctx *c)
{
    if (c->vec)
        to_radix26(dst, src64, c);
    else
        memcpy(dst, src64, sizeof(limb) * (size_t)c->s);
}

static void from_working(limb *dst64, const limb *src, const mont_ctx *c)
{
    if (c->vec)
        from_radix26(dst64, src, c);
    else
        memcpy(dst64, src, sizeof(limb) * (size_t)c->s);
}

static mont_ctx *ctx_new(const Py_buffer *modulus)
{
    if (modulus->len <= 0 || modulus->len % 8 != 0 || modulus->len / 8 > MAX_LIMBS) {
        PyErr_Format(PyExc_ValueError,
                     "modulus must be 8 * limbs bytes with 1 <= limbs <= %d, got %zd bytes",
                     MAX_LIMBS, modulus->len);
        return NULL;
    }
    mont_ctx *c = aligned_block(sizeof(mont_ctx));
    if (c == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    c->s = modulus->len / 8;
    load_limbs(c->m, modulus->buf, c->s);
    if ((c->m[0] & 1) == 0 || c->m[c->s - 1] == 0 || (c->s == 1 && c->m[0] == 1)) {
        PyErr_SetString(PyExc_ValueError,
                        "modulus must be odd, greater than 1, and have a non-zero top limb");
        aligned_free(c);
        return NULL;
    }
    /* Newton iteration for m^-1 mod 2^64 (each step doubles the correct low bits) */
    limb inv = c->m[0];
    for (int i = 0; i < 6; i++)
        inv *= 2 - c->m[0] * inv;
    c->minv = (limb)0 - inv;
    const int bits = (int)(64 * c->s - __builtin_clzll(c->m[c->s - 1]));
    c->n26 = (bits + RADIX - 1) / RADIX;
    c->vec = use_vector && c->n26 >= 2;
    c->w = c->vec ? (c->n26 + 3) / 4 * 4 + 4 : c->s;
    if (c->vec) {
        to_radix26(c->m26, c->m, c);
        c->m26_shifted[0] = 0;
        memcpy(c->m26_shifted + 1, c->m26, sizeof(limb) * (size_t)(c->w - 1));
        c->minv26 = c->minv & RADIX_MASK;
    }
    /* R mod m and R^2 mod m by doubling 1: slow-ish (128 * s^2 word steps) but only once */
    const Py_ssize_t r_bits = c->vec ? RADIX * c->n26 : 64 * c->s;
    limb x[MAX_LIMBS] = {0};
    x[0] = 1;
    for (Py_ssize_t i = 0; i < r_bits; i++)
        double_mod(x, c);
    to_working(c->one, x, c);
    for (Py_ssize_t i = 0; i < r_bits; i++)
        double_mod(x, c);
    to_working(c->r2, x, c);
    c->unit[0] = 1;
    return c;
}

/* Parse ``count`` values of s limbs each into working residues (w words each, not yet in
 * Montgomery form); all must be below m. */
static int load_residues(limb *out, const Py_buffer *buf, Py_ssize_t count, const mont_ctx *c,
                         const char *what)
{
    const Py_ssize_t s = c->s;
    if (buf->len != count * s * 8) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd bytes (%zd values of %zd bytes), got %zd",
                     what, count * s * 8, count, s * 8, buf->len);
        return -1;
    }
    const unsigned char *bytes = buf->buf;
    limb x[MAX_LIMBS];
    for (Py_ssize_t i = 0; i < count; i++) {
        load_limbs(x, bytes + i * s * 8, s);
        if (!below(x, c->m, s)) {
            PyErr_Format(PyExc_ValueError, "%s: value %zd is not below the modulus", what, i);
            return -1;
        }
        to_working(out + i * c->w, x, c);
    }
    return 0;
}

/* a working residue (out of Montgomery form) as s little-endian limbs of bytes */
static void store_residue(unsigned char *bytes, const limb *x, const mont_ctx *c)
{
    limb y[MAX_LIMBS];
    from_working(y, x, c);
    store_limbs(bytes, y, c->s);
}

static void to_mont(limb *x, const mont_ctx *c) { mont_mul(x, x, c->r2, c); }

static void from_mont(limb *x, const mont_ctx *c) { mont_mul(x, x, c->unit, c); }

/* ---------------------------------------------------------------- int64 buffers */

/* A C-contiguous int64 buffer of ``ndim`` dimensions. */
static int get_int64(PyObject *obj, Py_buffer *view, int ndim, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous int64 array", what);
        return -1;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0) ||
        view->ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous int64 array of %d dimension(s)",
                     what, ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- exponentiation helpers */

/* x <- x^e (e >= 1), left to right, in Montgomery form */
static void mont_pow_small(limb *x, uint64_t e, const mont_ctx *c)
{
    limb base[MAX_WORDS] ALIGNED;
    memcpy(base, x, sizeof(limb) * (size_t)c->w);
    int top = 63 - __builtin_clzll(e);
    for (int bit = top - 1; bit >= 0; bit--) {
        mont_sqr(x, x, c);
        if ((e >> bit) & 1)
            mont_mul(x, x, base, c);
    }
}

/*
 * prod_i bases[i]^digits[i] for digits in [0, 2^w): rows sorted by digit (counting sort,
 * descending); ``running`` is the product of the bases whose digit is at least v and the
 * total takes running^(v - next lower digit). One multiplication per non-zero row plus a few
 * per distinct digit: the bucket method's accumulation and aggregation fused into one pass.
 * Returns 0 when every digit is zero (total untouched).
 */
static int weighted_product(limb *total, const limb *bases, const uint32_t *digits,
                            Py_ssize_t rows, int window, uint32_t *counts, uint32_t *order,
                            limb *running, const mont_ctx *c)
{
    const Py_ssize_t s = c->w;
    const Py_ssize_t buckets = (Py_ssize_t)1 << window;
    memset(counts, 0, sizeof(uint32_t) * (size_t)(buckets + 1));
    for (Py_ssize_t i = 0; i < rows; i++)
        counts[digits[i]]++;
    /* starts for descending order, zero digits dropped */
    Py_ssize_t position = 0;
    for (Py_ssize_t v = buckets - 1; v >= 1; v--) {
        uint32_t n = counts[v];
        counts[v] = (uint32_t)position;
        position += n;
    }
    const Py_ssize_t nonzero = position;
    if (nonzero == 0)
        return 0;
    for (Py_ssize_t i = 0; i < rows; i++)
        if (digits[i])
            order[counts[digits[i]]++] = (uint32_t)i;
    /* after the scatter, counts[v] is the end of digit v's run */
    int started = 0;
    Py_ssize_t index = 0;
    limb term[MAX_WORDS] ALIGNED;
    memcpy(running, bases + (Py_ssize_t)order[0] * s, sizeof(limb) * (size_t)s);
    index = 1;
    Py_ssize_t v = digits[order[0]];
    while (v >= 1) {
        Py_ssize_t end = counts[v];
        for (; index < end; index++)
            mont_mul(running, running, bases + (Py_ssize_t)order[index] * s, c);
        Py_ssize_t next = index < nonzero ? digits[order[index]] : 0;
        uint64_t gap = (uint64_t)(v - next);
        memcpy(term, running, sizeof(limb) * (size_t)s);
        if (gap > 1)
            mont_pow_small(term, gap, c);
        if (started)
            mont_mul(total, total, term, c);
        else
            memcpy(total, term, sizeof(limb) * (size_t)s);
        started = 1;
        v = next;
    }
    return 1;
}

/* ---------------------------------------------------------------- dense multi-exponentiation */

static PyObject *dense_multiexp(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer modulus, bases_buf, exps, windows;
    PyObject *exps_obj, *windows_obj;
    if (!PyArg_ParseTuple(args, "y*y*OO", &modulus, &bases_buf, &exps_obj, &windows_obj))
        return NULL;
    PyObject *result = NULL;
    mont_ctx *c = NULL;
    limb *bases = NULL, *totals = NULL, *product = NULL, *running = NULL;
    uint32_t *digits = NULL, *counts = NULL, *order = NULL;
    int have_exps = 0, have_windows = 0;

    if (!(c = ctx_new(&modulus)))
        goto done;
    if (get_int64(exps_obj, &exps, 2, "exponents") < 0)
        goto done;
    have_exps = 1;
    if (get_int64(windows_obj, &windows, 1, "windows") < 0)
        goto done;
    have_windows = 1;
    /* ws: words per working residue; s: 64-bit limbs per value in and out */
    const Py_ssize_t ws = c->w, s = c->s, rows = exps.shape[0], cols = exps.shape[1];
    if (rows < 1 || rows > (Py_ssize_t)UINT32_MAX - 1) {
        PyErr_Format(PyExc_ValueError, "exponents must have between 1 and 2^32 - 2 rows, got %zd",
                     rows);
        goto done;
    }
    if (windows.shape[0] != cols) {
        PyErr_Format(PyExc_ValueError, "windows has %zd entries for %zd columns",
                     windows.shape[0], cols);
        goto done;
    }
    const int64_t *E = exps.buf, *W = windows.buf;
    for (Py_ssize_t j = 0; j < cols; j++)
        if (W[j] < 1 || W[j] > MAX_WINDOW) {
            PyErr_Format(PyExc_ValueError, "window of column %zd must be in [1, %d], got %lld", j,
                         MAX_WINDOW, (long long)W[j]);
            goto done;
        }
    for (Py_ssize_t k = 0; k < rows * cols; k++)
        if (E[k] < 0) {
            PyErr_Format(PyExc_ValueError,
                         "exponents must be non-negative: row %zd, column %zd holds %lld",
                         k / (cols ? cols : 1), k % (cols ? cols : 1), (long long)E[k]);
            goto done;
        }
    bases = aligned_block(sizeof(limb) * (size_t)(rows * ws));
    totals = aligned_block(sizeof(limb) * (size_t)((cols ? cols : 1) * ws));
    product = aligned_block(sizeof(limb) * (size_t)ws);
    running = aligned_block(sizeof(limb) * (size_t)ws);
    digits = PyMem_Malloc(sizeof(uint32_t) * (size_t)rows);
    order = PyMem_Malloc(sizeof(uint32_t) * (size_t)rows);
    counts = PyMem_Malloc(sizeof(uint32_t) * (((size_t)1 << MAX_WINDOW) + 1));
    if (!bases || !totals || !product || !running || !digits || !order || !counts) {
        PyErr_NoMemory();
        goto done;
    }
    if (load_residues(bases, &bases_buf, rows, c, "bases") < 0)
        goto done;

    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < rows; i++)
        to_mont(bases + i * ws, c);
    for (Py_ssize_t j = 0; j < cols; j++) {
        limb *total = totals + j * ws;
        const int w = (int)W[j];
        const uint64_t mask = ((uint64_t)1 << w) - 1;
        int64_t high = 0;
        for (Py_ssize_t i = 0; i < rows; i++)
            if (E[i * cols + j] > high)
                high = E[i * cols + j];
        const int bits = high ? 64 - __builtin_clzll((uint64_t)high) : 1;
        int started = 0;
        for (int pos = (bits + w - 1) / w - 1; pos >= 0; pos--) {
            if (started)
                for (int k = 0; k < w; k++)
                    mont_sqr(total, total, c);
            for (Py_ssize_t i = 0; i < rows; i++)
                digits[i] = (uint32_t)(((uint64_t)E[i * cols + j] >> (pos * w)) & mask);
            if (weighted_product(product, bases, digits, rows, w, counts, order, running, c)) {
                if (started)
                    mont_mul(total, total, product, c);
                else
                    memcpy(total, product, sizeof(limb) * (size_t)ws);
                started = 1;
            }
        }
        if (started)
            from_mont(total, c);
        else {
            memset(total, 0, sizeof(limb) * (size_t)ws); /* empty product: 1 */
            total[0] = 1;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyBytes_FromStringAndSize(NULL, cols * s * 8);
    if (result)
        for (Py_ssize_t j = 0; j < cols; j++)
            store_residue((unsigned char *)PyBytes_AS_STRING(result) + j * s * 8, totals + j * ws,
                          c);

done:
    if (have_exps)
        PyBuffer_Release(&exps);
    if (have_windows)
        PyBuffer_Release(&windows);
    PyBuffer_Release(&modulus);
    PyBuffer_Release(&bases_buf);
    aligned_free(c);
    aligned_free(bases);
    aligned_free(totals);
    aligned_free(product);
    aligned_free(running);
    PyMem_Free(digits);
    PyMem_Free(order);
    PyMem_Free(counts);
    return result;
}

/* ---------------------------------------------------------------- fixed-base tables */

/*
 * Row t of the table holds base^(v * 2^(w t)) for v in [0, 2^w), in Montgomery form, so
 * base^e is the product over t of row t's entry at e's t-th w-bit digit. The table lives in
 * a capsule: it cannot be forged or resized from Python, so lookups need no per-call check of
 * its contents, and the Montgomery constants are computed once per table.
 */
#define TABLE_CAPSULE "privreg.montgomery.table"

typedef struct {
    mont_ctx ctx;
    Py_ssize_t rows;
    int window;
    /* rows * 2^window Montgomery residues as s 64-bit limbs each (the compact form, also on
     * the vector path: an entry is converted as it is used, which costs far less than the
     * product and keeps the table's memory at its scalar size) */
    limb *entries;
} fb_table;

static void table_free(PyObject *capsule)
{
    fb_table *t = PyCapsule_GetPointer(capsule, TABLE_CAPSULE);
    if (t) {
        PyMem_RawFree(t->entries);
        aligned_free(t);
    }
}

static PyObject *fixed_base_table(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer modulus, base_buf;
    Py_ssize_t rows;
    int window;
    if (!PyArg_ParseTuple(args, "y*y*ni", &modulus, &base_buf, &rows, &window))
        return NULL;
    PyObject *capsule = NULL;
    fb_table *t = NULL;
    mont_ctx *c = ctx_new(&modulus);
    if (!c)
        goto done;
    if (window < 1 || window > 16 || rows < 1 || rows > (1 << 16)) {
        PyErr_Format(PyExc_ValueError, "window must be in [1, 16] and rows in [1, 65536], got "
                                       "%d and %zd", window, rows);
        goto done;
    }
    const Py_ssize_t s = c->s, width = (Py_ssize_t)1 << window;
    limb base[MAX_WORDS] ALIGNED, power[MAX_WORDS] ALIGNED;
    if (load_residues(base, &base_buf, 1, c, "base") < 0)
        goto done;
    t = aligned_block(sizeof(fb_table));
    if (!t) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(&t->ctx, c, sizeof(mont_ctx));
    t->rows = rows;
    t->window = window;
    /* raw allocator: filled without the GIL, possibly hundreds of MB */
    t->entries = PyMem_RawMalloc(sizeof(limb) * (size_t)rows * (size_t)width * (size_t)s);
    if (!t->entries) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    to_mont(base, c);
    for (Py_ssize_t r = 0; r < rows; r++) {
        limb *row = t->entries + r * width * s;
        from_working(row, c->one, c);
        memcpy(power, base, sizeof(limb) * (size_t)c->w);
        from_working(row + s, power, c);
        for (Py_ssize_t v = 2; v < width; v++) {
            mont_mul(power, power, base, c);
            from_working(row + v * s, power, c);
        }
        /* next row's base: base^(2^w) */
        mont_mul(base, power, base, c);
    }
    Py_END_ALLOW_THREADS
    capsule = PyCapsule_New(t, TABLE_CAPSULE, table_free);
    if (capsule)
        t = NULL; /* owned by the capsule now */
done:
    if (t) {
        PyMem_RawFree(t->entries);
        aligned_free(t);
    }
    aligned_free(c);
    PyBuffer_Release(&modulus);
    PyBuffer_Release(&base_buf);
    return capsule;
}

static PyObject *fixed_base_products(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *capsule, *digits_obj;
    if (!PyArg_ParseTuple(args, "OO", &capsule, &digits_obj))
        return NULL;
    fb_table *t = PyCapsule_GetPointer(capsule, TABLE_CAPSULE);
    if (!t) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "table must come from fixed_base_table");
        return NULL;
    }
    Py_buffer digits;
    if (get_int64(digits_obj, &digits, 2, "digits") < 0)
        return NULL;
    PyObject *result = NULL;
    limb *out = NULL;
    const mont_ctx *c = &t->ctx;
    const Py_ssize_t s = c->s, count = digits.shape[0], width = (Py_ssize_t)1 << t->window;
    if (digits.shape[1] != t->rows) {
        PyErr_Format(PyExc_ValueError, "digits have %zd columns but the table has %zd rows",
                     digits.shape[1], t->rows);
        goto done;
    }
    const int64_t *D = digits.buf;
    for (Py_ssize_t k = 0; k < count * t->rows; k++)
        if (D[k] < 0 || D[k] >= width) {
            PyErr_Format(PyExc_ValueError, "digit %lld of value %zd is outside [0, %zd)",
                         (long long)D[k], k / t->rows, width);
            goto done;
        }
    out = PyMem_Malloc(sizeof(limb) * (size_t)((count ? count : 1) * s));
    if (!out) {
        PyErr_NoMemory();
        goto done;
    }
    /* the capsule stays alive: we hold a reference to it through args for the whole call */
    Py_BEGIN_ALLOW_THREADS
    limb acc[MAX_WORDS] ALIGNED, entry[MAX_WORDS] ALIGNED;
    for (Py_ssize_t i = 0; i < count; i++) {
        int started = 0;
        for (Py_ssize_t r = 0; r < t->rows; r++) {
            /* masked again: the buffer is shared and could change after the check */
            Py_ssize_t v = (Py_ssize_t)((uint64_t)D[i * t->rows + r] & (uint64_t)(width - 1));
            if (!v)
                continue;
            to_working(started ? entry : acc, t->entries + (r * width + v) * s, c);
            if (started)
                mont_mul(acc, acc, entry, c);
            started = 1;
        }
        if (started) {
            from_mont(acc, c);
            from_working(out + i * s, acc, c);
        } else {
            memset(out + i * s, 0, sizeof(limb) * (size_t)s);
            out[i * s] = 1;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyBytes_FromStringAndSize(NULL, count * s * 8);
    if (result)
        for (Py_ssize_t i = 0; i < count; i++)
            store_limbs((unsigned char *)PyBytes_AS_STRING(result) + i * s * 8, out + i * s, s);
done:
    PyMem_Free(out);
    PyBuffer_Release(&digits);
    return result;
}

/* ---------------------------------------------------------------- measurement */

static PyObject *mul_chain(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer modulus, a_buf, b_buf;
    Py_ssize_t count;
    int square;
    if (!PyArg_ParseTuple(args, "y*y*y*np", &modulus, &a_buf, &b_buf, &count, &square))
        return NULL;
    PyObject *result = NULL;
    mont_ctx *c = ctx_new(&modulus);
    limb a[MAX_WORDS] ALIGNED, b[MAX_WORDS] ALIGNED;
    if (!c)
        goto done;
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "count must be non-negative");
        goto done;
    }
    if (load_residues(a, &a_buf, 1, c, "a") < 0 || load_residues(b, &b_buf, 1, c, "b") < 0)
        goto done;
    Py_BEGIN_ALLOW_THREADS
    to_mont(a, c);
    to_mont(b, c);
    for (Py_ssize_t k = 0; k < count; k++) {
        if (square)
            mont_sqr(a, a, c);
        else
            mont_mul(a, a, b, c);
    }
    from_mont(a, c);
    Py_END_ALLOW_THREADS
    result = PyBytes_FromStringAndSize(NULL, c->s * 8);
    if (result)
        store_residue((unsigned char *)PyBytes_AS_STRING(result), a, c);
done:
    aligned_free(c);
    PyBuffer_Release(&modulus);
    PyBuffer_Release(&a_buf);
    PyBuffer_Release(&b_buf);
    return result;
}

static PyObject *vector_unit(PyObject *self, PyObject *args)
{
    (void)self;
    int flag = -1;
    if (!PyArg_ParseTuple(args, "|i", &flag))
        return NULL;
    const int previous = use_vector;
#if HAVE_VECTOR
    if (flag >= 0)
        use_vector = flag && __builtin_cpu_supports("avx2");
#endif
    return PyBool_FromLong(previous);
}

static PyMethodDef methods[] = {
    {"dense_multiexp", dense_multiexp, METH_VARARGS,
     "dense_multiexp(modulus, bases, exponents, windows) -> bytes\n\n"
     "prod_i bases[i]^exponents[i, j] mod modulus for every column j (bucket method)."},
    {"fixed_base_table", fixed_base_table, METH_VARARGS,
     "fixed_base_table(modulus, base, rows, window) -> table\n\n"
     "Window table of a fixed base in Montgomery form (an opaque capsule)."},
    {"fixed_base_products", fixed_base_products, METH_VARARGS,
     "fixed_base_products(table, digits) -> bytes\n\n"
     "prod_t table[t][digits[i, t]] for every row i of the int64 digit matrix."},
    {"mul_chain", mul_chain, METH_VARARGS,
     "mul_chain(modulus, a, b, count, square) -> bytes\n\n"
     "a * b^count (or a^(2^count) when square) by count Montgomery steps: for tests and "
     "benchmarks."},
    {"vector_unit", vector_unit, METH_VARARGS,
     "vector_unit([flag]) -> bool\n\n"
     "Whether new contexts use the AVX2 product (set from the CPU at import); with a flag, "
     "switch it (still only where the CPU has AVX2) and return the previous setting."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_montgomery",
    "Montgomery multiplication kernels for Paillier (see core/paillier/native.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__montgomery(void)
{
#if HAVE_VECTOR
    __builtin_cpu_init();
    use_vector = __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "MAX_LIMBS", MAX_LIMBS) < 0 ||
              PyModule_AddIntConstant(m, "MAX_WINDOW", MAX_WINDOW) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
