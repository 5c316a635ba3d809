/*
 * Montgomery arithmetic modulo an arbitrary odd modulus, for Paillier's hot loops.
 *
 * Why this exists: X^T [[d]] and fixed-base encryption are long chains of multiplications
 * modulo n^2. Done from Python with gmpy2, every step allocates an mpz and reduces with a
 * full division; here a whole chain runs in C on Montgomery residues, with the GIL released.
 *
 * Three products, one per context, chosen at import from the CPU's features (the fastest it
 * has) or forced through product_path: AVX-512 IFMA code in radix 2^52 (ifma_body), AVX2 code
 * in radix 2^26 (vec_mul), and a portable one (Karatsuba product, product-scanning reduction).
 * The vector functions are compiled through target attributes, so the build needs no -march
 * flag and the module loads on any x86-64 CPU; a path runs only where cpuid reports it.
 *
 * Constructions followed. Montgomery reduction: P. L. Montgomery, "Modular multiplication
 * without trial division", Math. Comp. 44(170), 1985. The vector products are word-by-word
 * (operand scanning) Montgomery multiplication, one digit q per limb of a, interleaving the
 * product and the reduction, as the CIOS method in C. K. Koc, T. Acar, B. S. Kaliski,
 * "Analyzing and comparing Montgomery multiplication algorithms", IEEE Micro 16(3), 1996, but
 * with a redundant accumulator: limbs narrower than the lanes, so carries wait until the end.
 * The IFMA product follows the layout of S. Gueron and V. Krasnov, "Accelerating big integer
 * arithmetic using Intel IFMA extensions", ARITH 2016: 52-bit limbs in 64-bit lanes, the low
 * and high halves of each 104-bit product accumulated by vpmadd52luq / vpmadd52huq, the
 * accumulator shifted one lane per step. Its details here (register-resident accumulator of
 * fixed size per instantiation, q computed in scalar from lane 0, two independent products
 * interleaved where one product's dependency chain bounds the loop) are this file's own.
 * Every loop of the kernel runs on the context's product: fixed-base tables, the fused
 * bucket-method X^T [[d]] (weighted_product), the fixed-base lookups (two values at a time
 * on IFMA) and CRT decryption's fixed-exponent powers (two bases in lockstep). Two products
 * are interleaved on IFMA up to 3072-bit moduli (IFMA_PAIR_MAX_NW); above, where a timing
 * at first use shows the pair faster on this CPU (ifma_pairs_pay).
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
#if defined(__linux__)
#include <sys/mman.h>
#endif
#if !defined(_WIN32)
#include <pthread.h>
#include <time.h>
#endif

typedef uint64_t limb;
typedef unsigned __int128 dlimb;

/* 16384-bit moduli: n^2 of an 8192-bit key. Bounds the stack scratch of one product. */
#define MAX_LIMBS 256
#define MAX_WINDOW 18
/*
 * Vector loads are fastest from aligned addresses: residue arrays of the vector paths are
 * aligned (heap blocks through aligned_block; every residue is a multiple of 4 or 8 words).
 */
#if defined(__GNUC__) || defined(__clang__)
#define ALIGNED __attribute__((aligned(64)))
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

/* ask for the cache lines of ``words`` limbs from p (a read soon, kept in every level) */
static inline void prefetch_words(const limb *p, Py_ssize_t words)
{
#if defined(__GNUC__) || defined(__clang__)
    for (Py_ssize_t k = 0; k < words; k += 8)
        __builtin_prefetch(p + k, 0, 3);
#else
    (void)p;
    (void)words;
#endif
}

/*
 * A block read at random, not zeroed (its user writes every word): a fixed-base table (tens
 * to hundreds of MB) or the bucket method's bases (tens of MB at 30,000-100,000 rows). Where
 * the kernel offers transparent huge pages on request, the block asks for them: with 4 KB
 * pages nearly every lookup also missed the TLB. Freed with aligned_free.
 */
static void *table_block(size_t size)
{
#if defined(_WIN32)
    return PyMem_RawMalloc(size ? size : 1);
#else
    const size_t huge = (size_t)1 << 21;
    void *p = NULL;
    if (posix_memalign(&p, size >= huge ? huge : 64, size ? size : 1) != 0)
        return NULL;
#if defined(MADV_HUGEPAGE)
    if (size >= huge)
        (void)madvise(p, size, MADV_HUGEPAGE); /* advice: refused or ignored, small pages */
#endif
    return p;
#endif
}

/* the vector paths' residues: 26-bit (AVX2) or 52-bit (IFMA) limbs in 64-bit lanes */
#define RADIX 26
#define RADIX_MASK ((((limb)1) << RADIX) - 1)
#define RADIX52 52
#define MASK52 ((((limb)1) << RADIX52) - 1)
#define MAX_WORDS (((MAX_LIMBS * 64 + RADIX - 1) / RADIX + 3) / 4 * 4 + 4)
/* IFMA accumulators live in zmm registers: at most this many (8 lanes each, 8320 bits) */
#define IFMA_MAX_NW 20
/*
 * Largest accumulator (in registers) at which the kernel runs two products in flight
 * (mont_mul2: the bucket method's chains, fixed-base lookups, CRT decryption's powers).
 * Measured per product on a two-core Xeon with IFMA (a chain of 20,000, medians): two
 * interleaved products took 0.63 of two single ones' time at 512-1536 bits, 0.74 at 2048,
 * 0.84 at 2560 and 0.92 at 3072 bits (nw = 8), but 1.03 at 3584 and 4096 bits, where one
 * product alone keeps the multipliers busy (about one 512-bit multiply-add per cycle) and
 * two spill registers.
 */
#define IFMA_PAIR_MAX_NW 8
/*
 * Above that size the answer depends on the silicon: on a two-core AMD EPYC (Zen 4, whose
 * 512-bit multiply-adds issue as two 256-bit halves) two interleaved 4096-bit products took
 * 0.92 of two single ones'. So at larger sizes the kernel times both forms once per
 * accumulator size and process (a few hundred products, under a millisecond) and interleaves
 * where the pair was faster; the results are the same either way.
 */
static signed char ifma_pairs_pay[IFMA_MAX_NW + 1]; /* 0: not timed yet, 1: pair, -1: single */

enum { PATH_PORTABLE = 0, PATH_AVX2 = 1, PATH_IFMA = 2 };
static const char *const PATH_NAMES[] = {"portable", "avx2", "ifma"};

struct mont_ctx;
typedef void (*mul_fn)(limb *r, const limb *a, const limb *b, const struct mont_ctx *c);
typedef void (*mul2_fn)(limb *r, const limb *a, const limb *b, limb *r2, const limb *a2,
                        const limb *b2, const struct mont_ctx *c);

/*
 * A modulus and its Montgomery constants. Residues live in one of three working
 * representations, fixed per context: 64-bit limbs (``s`` words, the portable path), 26-bit
 * limbs in 64-bit lanes (AVX2) or 52-bit limbs in 64-bit lanes (IFMA); ``w`` is the size of
 * every working residue buffer; R is 2^(64 s) or 2^(radix nl) accordingly.
 */
typedef struct mont_ctx {
    Py_ssize_t s; /* 64-bit limbs of m */
    limb m[MAX_LIMBS];
    limb minv; /* -m^-1 mod 2^64 */
    int path;  /* PATH_*: working representation and product */
    int radix; /* 26 or 52 on the vector paths */
    Py_ssize_t nl; /* radix limbs of m (vector paths) */
    Py_ssize_t w;  /* words per working residue: s, or padded nl (see ctx_new) */
    mul_fn ifma;   /* the IFMA product for this size (register-resident accumulator) */
    mul2_fn ifma2; /* two independent IFMA products, interleaved */
    int interleave; /* whether two interleaved products beat two single ones (see below) */
    limb mr[MAX_WORDS] ALIGNED;
    limb mr_shifted[MAX_WORDS] ALIGNED; /* mr one lane up (lane 0 zero) */
    limb minvr;                  /* -m^-1 mod 2^radix */
    limb one[MAX_WORDS] ALIGNED; /* R mod m: 1 in Montgomery form */
    limb r2[MAX_WORDS] ALIGNED;  /* R^2 mod m: converts into Montgomery form */
    limb unit[MAX_WORDS] ALIGNED; /* the integer 1: converts out of Montgomery form */
} mont_ctx;

/* the path new contexts use (set at import from the CPU's features, or forced) */
static int current_path = PATH_PORTABLE;

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
 * Bounds: lanes stay below 2 * nl * 2^52 + 2^38 < 2^63 for nl <= 640. Inputs below m
 * (limbs below 2^26, lanes from nl on zero), output likewise; r may alias a or b.
 */
__attribute__((target("avx2"))) static void vec_mul(limb *r, const limb *a, const limb *b,
                                                    const mont_ctx *c)
{
    const Py_ssize_t n = c->nl, w = c->w;
    const limb *m = c->mr, *m1 = c->mr_shifted, minv = c->minvr;
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

#define IFMA_TARGET __attribute__((target("avx512f,avx512ifma,avx512vl")))

/*
 * Montgomery product in radix 2^52 with AVX-512 IFMA, for ``ways`` (1 or 2) independent
 * products modulo the same m, interleaved. Word-by-word (operand scanning) Montgomery
 * multiplication with a redundant accumulator: for each limb a_i of a,
 *   X += a_i * b + q * m   with q = (X_0 + a_i b_0) (-m^-1) mod 2^52,
 * then X is shifted down one limb (its low limb is zero mod 2^52 by the choice of q). The low
 * halves of the 104-bit products (vpmadd52luq) add at lane j, the high halves (vpmadd52huq)
 * at lane j + 1, which is lane j of b and m shifted one lane up (b1, mr_shifted). X lives in
 * nw zmm registers (nw <= IFMA_MAX_NW, fixed per instantiation so the compiler keeps them in
 * registers); only lane 0 is read back per step, and its carry is kept in a scalar (the lane
 * itself is dropped by the shift). Lanes gain below 2^54 per step, so they stay below
 * nl * 2^54 < 2^62: no carry handling until the end. The loop-carried chain (lane 0 ->
 * scalar q -> broadcast -> two multiply-adds -> shift) is latency bound where nw is small,
 * hence the two-way variant, whose chains overlap. Inputs below m (lanes from nl on zero),
 * output likewise; r may alias a or b (written after the loop).
 */
IFMA_TARGET static inline __attribute__((always_inline)) void
ifma_body(limb *const *r, const limb *const *a, const limb *const *b, const mont_ctx *c,
          const int nw, const int ways)
{
    const Py_ssize_t n = c->nl;
    const limb minv = c->minvr, m0 = c->mr[0];
    const __m512i zero = _mm512_setzero_si512();
    __m512i X[2][IFMA_MAX_NW];
    limb b1[2][IFMA_MAX_NW * 8] ALIGNED;
    limb carry[2] = {0, 0};
#pragma GCC unroll 2
    for (int u = 0; u < ways; u++) {
        b1[u][0] = 0;
        memcpy(b1[u] + 1, b[u], sizeof(limb) * (size_t)(8 * nw - 1));
#pragma GCC unroll 20
        for (int k = 0; k < nw; k++)
            X[u][k] = zero;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
#pragma GCC unroll 2
        for (int u = 0; u < ways; u++) {
            const limb ai = a[u][i];
            const limb x0 = (limb)_mm_cvtsi128_si64(_mm512_castsi512_si128(X[u][0])) + carry[u];
            const limb ab = ai * b[u][0];
            const limb q = ((x0 + ab) * minv) & MASK52;
            carry[u] = (x0 + (ab & MASK52) + ((q * m0) & MASK52)) >> RADIX52;
            const __m512i A = _mm512_set1_epi64((long long)ai);
            const __m512i Q = _mm512_set1_epi64((long long)q);
#pragma GCC unroll 20
            for (int k = 0; k < nw; k++) {
                __m512i x = _mm512_madd52lo_epu64(X[u][k], A, _mm512_loadu_si512(b[u] + 8 * k));
                x = _mm512_madd52hi_epu64(x, A, _mm512_loadu_si512(b1[u] + 8 * k));
                x = _mm512_madd52lo_epu64(x, Q, _mm512_loadu_si512(c->mr + 8 * k));
                X[u][k] = _mm512_madd52hi_epu64(x, Q, _mm512_loadu_si512(c->mr_shifted + 8 * k));
            }
#pragma GCC unroll 20
            for (int k = 0; k + 1 < nw; k++)
                X[u][k] = _mm512_alignr_epi64(X[u][k + 1], X[u][k], 1);
            X[u][nw - 1] = _mm512_alignr_epi64(zero, X[u][nw - 1], 1);
        }
    }
#pragma GCC unroll 2
    for (int u = 0; u < ways; u++) {
        limb T[IFMA_MAX_NW * 8] ALIGNED, out[IFMA_MAX_NW * 8 + 1], d[IFMA_MAX_NW * 8];
#pragma GCC unroll 20
        for (int k = 0; k < nw; k++)
            _mm512_store_si512((__m512i *)(T + 8 * k), X[u][k]);
        T[0] += carry[u];
        /* T / R in normalised limbs: below 2m, so nl limbs and a top bit */
        limb cy = 0;
        for (Py_ssize_t k = 0; k < n; k++) {
            const limb v = T[k] + cy;
            out[k] = v & MASK52;
            cy = v >> RADIX52;
        }
        int64_t borrow = 0;
        for (Py_ssize_t k = 0; k < n; k++) {
            const int64_t v = (int64_t)out[k] - (int64_t)c->mr[k] + borrow;
            d[k] = (limb)v & MASK52;
            borrow = v >> RADIX52; /* 0 or -1 */
        }
        memcpy(r[u], (cy || !borrow) ? d : out, sizeof(limb) * (size_t)n);
        memset(r[u] + n, 0, sizeof(limb) * (size_t)(c->w - n));
    }
}

#define IFMA_SIZE(NW)                                                                      \
    IFMA_TARGET static void ifma_mul_##NW(limb *r, const limb *a, const limb *b,           \
                                          const mont_ctx *c)                               \
    {                                                                                      \
        limb *rs[2] = {r, r};                                                              \
        const limb *as[2] = {a, a}, *bs[2] = {b, b};                                       \
        ifma_body(rs, as, bs, c, NW, 1);                                                   \
    }                                                                                      \
    IFMA_TARGET static void ifma_mul2_##NW(limb *r, const limb *a, const limb *b, limb *r2, \
                                           const limb *a2, const limb *b2,                 \
                                           const mont_ctx *c)                              \
    {                                                                                      \
        limb *rs[2] = {r, r2};                                                             \
        const limb *as[2] = {a, a2}, *bs[2] = {b, b2};                                     \
        ifma_body(rs, as, bs, c, NW, 2);                                                   \
    }
IFMA_SIZE(1) IFMA_SIZE(2) IFMA_SIZE(3) IFMA_SIZE(4) IFMA_SIZE(5) IFMA_SIZE(6) IFMA_SIZE(7)
IFMA_SIZE(8) IFMA_SIZE(9) IFMA_SIZE(10) IFMA_SIZE(11) IFMA_SIZE(12) IFMA_SIZE(13)
IFMA_SIZE(14) IFMA_SIZE(15) IFMA_SIZE(16) IFMA_SIZE(17) IFMA_SIZE(18) IFMA_SIZE(19)
IFMA_SIZE(20)

static const mul_fn IFMA_MUL[IFMA_MAX_NW + 1] = {
    NULL, ifma_mul_1, ifma_mul_2, ifma_mul_3, ifma_mul_4, ifma_mul_5, ifma_mul_6,
    ifma_mul_7, ifma_mul_8, ifma_mul_9, ifma_mul_10, ifma_mul_11, ifma_mul_12, ifma_mul_13,
    ifma_mul_14, ifma_mul_15, ifma_mul_16, ifma_mul_17, ifma_mul_18, ifma_mul_19, ifma_mul_20,
};
static const mul2_fn IFMA_MUL2[IFMA_MAX_NW + 1] = {
    NULL, ifma_mul2_1, ifma_mul2_2, ifma_mul2_3, ifma_mul2_4, ifma_mul2_5, ifma_mul2_6,
    ifma_mul2_7, ifma_mul2_8, ifma_mul2_9, ifma_mul2_10, ifma_mul2_11, ifma_mul2_12,
    ifma_mul2_13, ifma_mul2_14, ifma_mul2_15, ifma_mul2_16, ifma_mul2_17, ifma_mul2_18,
    ifma_mul2_19, ifma_mul2_20,
};
#else
#define HAVE_VECTOR 0
#endif

/* whether this build and this CPU can run a path */
static int path_supported(int path)
{
    if (path == PATH_PORTABLE)
        return 1;
#if HAVE_VECTOR
    if (path == PATH_AVX2)
        return __builtin_cpu_supports("avx2");
    if (path == PATH_IFMA)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512ifma") &&
               __builtin_cpu_supports("avx512vl");
#endif
    return 0;
}

static void mont_mul(limb *r, const limb *a, const limb *b, const mont_ctx *c)
{
#if HAVE_VECTOR
    if (c->path == PATH_IFMA) {
        c->ifma(r, a, b, c);
        return;
    }
    if (c->path == PATH_AVX2) {
        vec_mul(r, a, b, c);
        return;
    }
#endif
    mont_mul64(r, a, b, c);
}

static void mont_sqr(limb *r, const limb *a, const mont_ctx *c)
{
#if HAVE_VECTOR
    if (c->path != PATH_PORTABLE) {
        mont_mul(r, a, a, c);
        return;
    }
#endif
    mont_sqr64(r, a, c);
}

/*
 * Two independent products modulo the same m: interleaved on the IFMA path where that is
 * faster (c->interleave), else one after the other. r must not alias a2 or b2 (one after the
 * other, r is written before they are read).
 */
static void mont_mul2(limb *r, const limb *a, const limb *b, limb *r2, const limb *a2,
                      const limb *b2, const mont_ctx *c)
{
#if HAVE_VECTOR
    if (c->interleave) {
        c->ifma2(r, a, b, r2, a2, b2, c);
        return;
    }
#endif
    mont_mul(r, a, b, c);
    mont_mul(r2, a2, b2, c);
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

/* 64-bit limbs (s words) to a vector representation (w words, zero padded) */
static void to_radix(limb *dst, const limb *src, const mont_ctx *c)
{
    const int radix = c->radix;
    const limb mask = (((limb)1) << radix) - 1;
    Py_ssize_t k = 0;
#if HAVE_VECTOR
    /* x86-64 words are little-endian: limb k is the 8 bytes from bit k * radix's byte,
     * shifted by at most 7 bits (radix <= 56), while those bytes lie inside src. One load per
     * limb instead of one or two word loads and a data-dependent branch: this runs once per
     * fixed-base table lookup, beside a single product. */
    const unsigned char *bytes = (const unsigned char *)src;
    for (; k < c->nl; k++) {
        const Py_ssize_t bit = k * radix;
        if ((bit >> 3) + 8 > 8 * c->s)
            break;
        limb v;
        memcpy(&v, bytes + (bit >> 3), sizeof v);
        dst[k] = (v >> (bit & 7)) & mask;
    }
#endif
    for (; k < c->nl; k++) { /* the last limbs (or every limb elsewhere): word by word */
        const Py_ssize_t bit = k * radix, word = bit >> 6;
        const int offset = (int)(bit & 63);
        limb v = src[word] >> offset;
        if (offset > 64 - radix && word + 1 < c->s)
            v |= src[word + 1] << (64 - offset);
        dst[k] = v & mask;
    }
    memset(dst + c->nl, 0, sizeof(limb) * (size_t)(c->w - c->nl));
}

/* a vector representation (a value below m) back to 64-bit limbs (s words) */
static void from_radix(limb *dst, const limb *src, const mont_ctx *c)
{
    const int radix = c->radix;
    memset(dst, 0, sizeof(limb) * (size_t)c->s);
    for (Py_ssize_t k = 0; k < c->nl; k++) {
        const Py_ssize_t bit = k * radix, word = bit >> 6;
        const int offset = (int)(bit & 63);
        dst[word] |= src[k] << offset;
        if (offset > 64 - radix && word + 1 < c->s)
            dst[word + 1] |= src[k] >> (64 - offset);
    }
}

/* working representation <-> 64-bit limbs */
static void to_working(limb *dst, const limb *src64, const mont_ctx *c)
{
    if (c->path != PATH_PORTABLE)
        to_radix(dst, src64, c);
    else
        memcpy(dst, src64, sizeof(limb) * (size_t)c->s);
}

static void from_working(limb *dst64, const limb *src, const mont_ctx *c)
{
    if (c->path != PATH_PORTABLE)
        from_radix(dst64, src, c);
    else
        memcpy(dst64, src, sizeof(limb) * (size_t)c->s);
}

/*
 * The context's path: the process's current one where it fits the modulus. IFMA keeps its
 * accumulator (nl + 1 lanes: the top lane takes the last high halves) in at most
 * IFMA_MAX_NW registers, so larger moduli fall back to AVX2 (or portable) there; a one-limb
 * modulus stays portable.
 */
static void choose_path(mont_ctx *c, int bits)
{
    int path = current_path;
    if (path == PATH_IFMA && (bits + RADIX52 - 1) / RADIX52 + 1 > 8 * IFMA_MAX_NW)
        path = path_supported(PATH_AVX2) ? PATH_AVX2 : PATH_PORTABLE;
    if (path != PATH_PORTABLE && (bits + RADIX - 1) / RADIX < 2)
        path = PATH_PORTABLE;
    c->path = path;
    c->interleave = 0;
    if (path == PATH_PORTABLE) {
        c->radix = 64;
        c->nl = c->s;
        c->w = c->s;
        return;
    }
    c->radix = path == PATH_IFMA ? RADIX52 : RADIX;
    c->nl = (bits + c->radix - 1) / c->radix;
    if (path == PATH_IFMA) {
        const Py_ssize_t nw = (c->nl + 8) / 8;
        c->w = 8 * nw;
#if HAVE_VECTOR
        c->ifma = IFMA_MUL[nw];
        c->ifma2 = IFMA_MUL2[nw];
        c->interleave = nw <= IFMA_PAIR_MAX_NW;
#endif
    } else
        c->w = (c->nl + 3) / 4 * 4 + 4;
    to_radix(c->mr, c->m, c);
    c->mr_shifted[0] = 0;
    memcpy(c->mr_shifted + 1, c->mr, sizeof(limb) * (size_t)(c->w - 1));
    c->minvr = c->minv & ((((limb)1) << c->radix) - 1);
}

#if HAVE_VECTOR && !defined(_WIN32)
static double seconds_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* whether two interleaved IFMA products beat two single ones at c's size (timed once) */
static int pairs_pay(const mont_ctx *c)
{
    const Py_ssize_t nw = c->w / 8;
    if (ifma_pairs_pay[nw])
        return ifma_pairs_pay[nw] > 0;
    limb a[MAX_WORDS] ALIGNED, a2[MAX_WORDS] ALIGNED;
    memcpy(a, c->r2, sizeof(limb) * (size_t)c->w);
    memcpy(a2, c->one, sizeof(limb) * (size_t)c->w);
    double single = 1e9, pair = 1e9;
    for (int trial = 0; trial < 5; trial++) { /* the best of five: least disturbed */
        double start = seconds_now();
        for (int k = 0; k < 32; k++)
            c->ifma(a, a, c->r2, c);
        double middle = seconds_now();
        for (int k = 0; k < 16; k++)
            c->ifma2(a, a, c->r2, a2, a2, c->r2, c);
        double end = seconds_now();
        single = middle - start < single ? middle - start : single;
        pair = end - middle < pair ? end - middle : pair;
    }
    ifma_pairs_pay[nw] = pair < 0.97 * single ? 1 : -1;
    return ifma_pairs_pay[nw] > 0;
}
#endif

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
    choose_path(c, bits);
    /* R mod m and R^2 mod m by doubling 1: slow-ish (128 * s^2 word steps) but only once */
    const Py_ssize_t r_bits = c->path != PATH_PORTABLE ? c->radix * c->nl : 64 * c->s;
    limb x[MAX_LIMBS] = {0};
    x[0] = 1;
    for (Py_ssize_t i = 0; i < r_bits; i++)
        double_mod(x, c);
    to_working(c->one, x, c);
    for (Py_ssize_t i = 0; i < r_bits; i++)
        double_mod(x, c);
    to_working(c->r2, x, c);
    c->unit[0] = 1;
#if HAVE_VECTOR && !defined(_WIN32)
    if (c->path == PATH_IFMA && !c->interleave)
        c->interleave = pairs_pay(c);
#endif
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
 * A product held back to run beside the next one (mul_or_pair). Where the context interleaves,
 * the bucket method's aggregation (total *= term) waits for the next row's product into the
 * running one: the two chains are independent, so one interleaved call does both.
 */
typedef struct {
    limb *r;
    const limb *a, *b;
} deferred_mul;

/* r = a b, beside the deferred product if one is waiting (which is then done) */
static void mul_or_pair(limb *r, const limb *a, const limb *b, deferred_mul *d,
                        const mont_ctx *c)
{
    if (d->r) {
        mont_mul2(d->r, d->a, d->b, r, a, b, c);
        d->r = NULL;
    } else
        mont_mul(r, a, b, c);
}

/*
 * prod_i bases[i]^digits[i] for digits in [0, 2^w): rows sorted by digit (counting sort,
 * descending); ``running`` is the product of the bases whose digit is at least v and the
 * total takes running^(v - next lower digit). One multiplication per non-zero row plus a few
 * per distinct digit: the bucket method's accumulation and aggregation fused into one pass.
 * Returns 0 when every digit is zero (total untouched).
 *
 * Where the context interleaves (c->interleave: IFMA, moduli up to 3072 bits, where one
 * product's dependency chain bounds the loop), two products are kept in flight: a run of at
 * least three rows with the same digit is split into two chains (running takes every other
 * base, ``partial`` the rest, then running *= partial: one product more per run, each pair
 * in one interleaved call), and each aggregation product runs beside the next accumulation
 * product. Every product is fully reduced, so the total is the same residue bit for bit as
 * the one-chain order's (Montgomery products of residues below m are unique).
 */
#define BASE_AHEAD 4

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
    const int interleave = c->interleave;
    int started = 0;
    Py_ssize_t index = 0;
    limb term[MAX_WORDS] ALIGNED, partial[MAX_WORDS] ALIGNED;
    deferred_mul pending = {NULL, NULL, NULL};
#define BASE(k) (bases + (Py_ssize_t)order[(k)] * s)
/* the bases are visited in digit order, at random in memory: each is requested a few
 * products ahead, or its first read stalls the product (many MB of bases miss the caches) */
#define PREFETCH_BASE(k)                                                                   \
    do {                                                                                   \
        if ((k) < nonzero)                                                                 \
            prefetch_words(BASE(k), s);                                                    \
    } while (0)
    for (Py_ssize_t k = 0; k < BASE_AHEAD; k++)
        PREFETCH_BASE(k);
    memcpy(running, BASE(0), sizeof(limb) * (size_t)s);
    index = 1;
    Py_ssize_t v = digits[order[0]];
    while (v >= 1) {
        Py_ssize_t end = counts[v];
        if (interleave && end - index >= 3) {
            memcpy(partial, BASE(index), sizeof(limb) * (size_t)s);
            for (index++; index + 1 < end; index += 2) {
                PREFETCH_BASE(index + BASE_AHEAD);
                PREFETCH_BASE(index + BASE_AHEAD + 1);
                mont_mul2(running, running, BASE(index), partial, partial, BASE(index + 1), c);
            }
            if (index < end) {
                PREFETCH_BASE(index + BASE_AHEAD);
                mul_or_pair(running, running, BASE(index++), &pending, c);
            }
            mul_or_pair(running, running, partial, &pending, c);
        } else
            for (; index < end; index++) {
                PREFETCH_BASE(index + BASE_AHEAD);
                mul_or_pair(running, running, BASE(index), &pending, c);
            }
        if (pending.r) { /* a run without products (only the first can be): do it alone */
            mont_mul(pending.r, pending.a, pending.b, c);
            pending.r = NULL;
        }
        Py_ssize_t next = index < nonzero ? digits[order[index]] : 0;
        uint64_t gap = (uint64_t)(v - next);
        memcpy(term, running, sizeof(limb) * (size_t)s);
        if (gap > 1)
            mont_pow_small(term, gap, c);
        if (!started)
            memcpy(total, term, sizeof(limb) * (size_t)s);
        else if (interleave) /* term stays untouched until the next run's first product */
            pending = (deferred_mul){total, total, term};
        else
            mont_mul(total, total, term, c);
        started = 1;
        v = next;
    }
#undef PREFETCH_BASE
#undef BASE
    if (pending.r)
        mont_mul(pending.r, pending.a, pending.b, c);
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
    bases = table_block(sizeof(limb) * (size_t)(rows * ws)); /* every residue is written */
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
        aligned_free(t->entries);
        aligned_free(t);
    }
}

/* rows [first, last) of a table; base: row first's base, to_mont'ed, in working form */
static void fill_rows(fb_table *t, Py_ssize_t first, Py_ssize_t last, const limb *row_base)
{
    const mont_ctx *c = &t->ctx;
    const Py_ssize_t s = c->s, width = (Py_ssize_t)1 << t->window;
    limb base[MAX_WORDS] ALIGNED, power[MAX_WORDS] ALIGNED;
    memcpy(base, row_base, sizeof(limb) * (size_t)c->w);
    for (Py_ssize_t r = first; r < last; r++) {
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
}

/*
 * A share of the rows, for one of several threads building a table at once: the share's
 * first base is row 0's raised to 2^(w first) by squarings (w first of them: a few
 * thousand products, against 2^w per row), so every entry equals the one-thread build's.
 */
typedef struct {
    fb_table *t;
    Py_ssize_t first, last;
    const limb *base; /* row 0's base, Montgomery and working form */
} table_share;

static void *fill_share(void *arg)
{
    const table_share *share = arg;
    const mont_ctx *c = &share->t->ctx;
    limb base[MAX_WORDS] ALIGNED;
    memcpy(base, share->base, sizeof(limb) * (size_t)c->w);
    for (Py_ssize_t k = 0; k < share->first * share->t->window; k++)
        mont_sqr(base, base, c);
    fill_rows(share->t, share->first, share->last, base);
    return NULL;
}

#define MAX_BUILD_THREADS 64

/* all rows of t from row 0's base, on up to ``threads`` threads (this one included) */
static void fill_table(fb_table *t, const limb *base, int threads)
{
    if (threads > t->rows)
        threads = (int)t->rows;
#if defined(_WIN32)
    threads = 1;
#endif
    if (threads <= 1) {
        fill_rows(t, 0, t->rows, base);
        return;
    }
#if !defined(_WIN32)
    table_share shares[MAX_BUILD_THREADS];
    pthread_t ids[MAX_BUILD_THREADS];
    int started[MAX_BUILD_THREADS] = {0};
    for (int k = 0; k < threads; k++) {
        shares[k].t = t;
        shares[k].first = t->rows * k / threads;
        shares[k].last = t->rows * (k + 1) / threads;
        shares[k].base = base;
    }
    for (int k = 1; k < threads; k++)
        started[k] = pthread_create(&ids[k], NULL, fill_share, &shares[k]) == 0;
    fill_share(&shares[0]);
    for (int k = 1; k < threads; k++) {
        if (started[k])
            pthread_join(ids[k], NULL);
        else
            fill_share(&shares[k]); /* no thread to be had: this one does the share */
    }
#endif
}

static PyObject *fixed_base_table(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer modulus, base_buf;
    Py_ssize_t rows;
    int window, threads = 1;
    if (!PyArg_ParseTuple(args, "y*y*ni|i", &modulus, &base_buf, &rows, &window, &threads))
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
    if (threads < 1 || threads > MAX_BUILD_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads must be in [1, %d], got %d", MAX_BUILD_THREADS,
                     threads);
        goto done;
    }
    const Py_ssize_t s = c->s, width = (Py_ssize_t)1 << window;
    limb base[MAX_WORDS] ALIGNED;
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
    /* not the Python allocator: filled without the GIL, possibly hundreds of MB */
    t->entries = table_block(sizeof(limb) * (size_t)rows * (size_t)width * (size_t)s);
    if (!t->entries) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    to_mont(base, c);
    fill_table(t, base, threads);
    Py_END_ALLOW_THREADS
    capsule = PyCapsule_New(t, TABLE_CAPSULE, table_free);
    if (capsule)
        t = NULL; /* owned by the capsule now */
done:
    if (t) {
        aligned_free(t->entries);
        aligned_free(t);
    }
    aligned_free(c);
    PyBuffer_Release(&modulus);
    PyBuffer_Release(&base_buf);
    return capsule;
}

/*
 * A large table (hundreds of MB at 12-bit windows) is read at random: each entry is a cache
 * and TLB miss that costs about as much as the product it feeds, unless it is requested a
 * few products ahead.
 */
#define PREFETCH_AHEAD 4

static inline void prefetch_entry(const limb *entry, Py_ssize_t s)
{
#if defined(__GNUC__) || defined(__clang__)
    for (Py_ssize_t k = 0; k < s; k += 8)
        __builtin_prefetch(entry + k, 0, 0);
#else
    (void)entry;
    (void)s;
#endif
}

/*
 * Two values' products at once through the interleaved product (the IFMA path, where one
 * product's dependency chain leaves the multipliers idle). A zero digit multiplies by the
 * row's entry 0, which is 1 in Montgomery form: the product is unchanged and still fully
 * reduced, so the results equal the one-at-a-time loop's bit for bit.
 */
static void table_lookup_pair(const fb_table *t, const int64_t *digits, limb *out)
{
    const mont_ctx *c = &t->ctx;
    const Py_ssize_t s = c->s, width = (Py_ssize_t)1 << t->window, rows = t->rows;
    const uint64_t mask = (uint64_t)(width - 1);
    limb acc[2][MAX_WORDS] ALIGNED, entry[2][MAX_WORDS] ALIGNED;
    for (Py_ssize_t r = 0; r < rows; r++) {
        /* masked again: the buffer is shared and could change after the check */
        const Py_ssize_t v0 = (Py_ssize_t)((uint64_t)digits[r] & mask);
        const Py_ssize_t v1 = (Py_ssize_t)((uint64_t)digits[rows + r] & mask);
        if (r + PREFETCH_AHEAD < rows) {
            const Py_ssize_t ahead = r + PREFETCH_AHEAD;
            const uint64_t u0 = (uint64_t)digits[ahead] & mask;
            const uint64_t u1 = (uint64_t)digits[rows + ahead] & mask;
            prefetch_entry(t->entries + (ahead * width + (Py_ssize_t)u0) * s, s);
            prefetch_entry(t->entries + (ahead * width + (Py_ssize_t)u1) * s, s);
        }
        if (r == 0) {
            to_working(acc[0], t->entries + v0 * s, c);
            to_working(acc[1], t->entries + v1 * s, c);
            continue;
        }
        if (!v0 && !v1)
            continue;
        to_working(entry[0], t->entries + (r * width + v0) * s, c);
        to_working(entry[1], t->entries + (r * width + v1) * s, c);
        mont_mul2(acc[0], acc[0], entry[0], acc[1], acc[1], entry[1], c);
    }
    mont_mul2(acc[0], acc[0], c->unit, acc[1], acc[1], c->unit, c); /* out of Montgomery form */
    from_working(out, acc[0], c);
    from_working(out + s, acc[1], c);
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
    Py_ssize_t i = 0;
    if (c->path == PATH_IFMA)
        for (; i + 1 < count; i += 2)
            table_lookup_pair(t, D + i * t->rows, out + i * s);
    for (; i < count; i++) {
        int started = 0;
        for (Py_ssize_t r = 0; r < t->rows; r++) {
            /* masked again: the buffer is shared and could change after the check */
            Py_ssize_t v = (Py_ssize_t)((uint64_t)D[i * t->rows + r] & (uint64_t)(width - 1));
            if (r + PREFETCH_AHEAD < t->rows) {
                const Py_ssize_t ahead = r + PREFETCH_AHEAD;
                const uint64_t u = (uint64_t)D[i * t->rows + ahead] & (uint64_t)(width - 1);
                prefetch_entry(t->entries + (ahead * width + (Py_ssize_t)u) * s, s);
            }
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

/* ---------------------------------------------------------------- fixed-exponent powers */

#define POW_WINDOW 5

/*
 * bases[i]^e for two bases at once, left to right with fixed POW_WINDOW-bit windows: both
 * follow the same exponent, so they step in lockstep through the interleaved product. The
 * table lookups and the skipped multiplications depend on e's digits: like GMP's mpz_powm,
 * which CRT decryption used before, this is not constant-time in e (see the file's note).
 */
static void pow_pair(limb *x0, limb *x1, const limb *e, Py_ssize_t e_bits, limb *table,
                     const mont_ctx *c)
{
    const Py_ssize_t w = c->w, entries = (Py_ssize_t)1 << POW_WINDOW;
    limb *t0 = table, *t1 = table + entries * w;
    to_mont(x0, c);
    to_mont(x1, c);
    memcpy(t0, c->one, sizeof(limb) * (size_t)w);
    memcpy(t1, c->one, sizeof(limb) * (size_t)w);
    memcpy(t0 + w, x0, sizeof(limb) * (size_t)w);
    memcpy(t1 + w, x1, sizeof(limb) * (size_t)w);
    for (Py_ssize_t v = 2; v < entries; v++)
        mont_mul2(t0 + v * w, t0 + (v - 1) * w, x0, t1 + v * w, t1 + (v - 1) * w, x1, c);
    const Py_ssize_t windows = (e_bits + POW_WINDOW - 1) / POW_WINDOW;
    for (Py_ssize_t pos = windows - 1; pos >= 0; pos--) {
        Py_ssize_t digit = 0;
        for (int k = POW_WINDOW - 1; k >= 0; k--) {
            const Py_ssize_t bit = pos * POW_WINDOW + k;
            const limb set = bit < e_bits ? (e[bit >> 6] >> (bit & 63)) & 1 : 0;
            digit = (digit << 1) | (Py_ssize_t)set;
        }
        if (pos == windows - 1) {
            memcpy(x0, t0 + digit * w, sizeof(limb) * (size_t)w);
            memcpy(x1, t1 + digit * w, sizeof(limb) * (size_t)w);
            continue;
        }
        for (int k = 0; k < POW_WINDOW; k++)
            mont_mul2(x0, x0, x0, x1, x1, x1, c);
        if (digit)
            mont_mul2(x0, x0, t0 + digit * w, x1, x1, t1 + digit * w, c);
    }
    if (windows == 0) { /* e = 0 */
        memcpy(x0, c->one, sizeof(limb) * (size_t)w);
        memcpy(x1, c->one, sizeof(limb) * (size_t)w);
    }
    mont_mul2(x0, x0, c->unit, x1, x1, c->unit, c);
}

static PyObject *powmod_fixed(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer modulus, bases_buf, exp_buf;
    if (!PyArg_ParseTuple(args, "y*y*y*", &modulus, &bases_buf, &exp_buf))
        return NULL;
    PyObject *result = NULL;
    limb *values = NULL, *table = NULL;
    limb e[MAX_LIMBS] = {0};
    mont_ctx *c = ctx_new(&modulus);
    if (!c)
        goto done;
    const Py_ssize_t s = c->s, w = c->w;
    if (exp_buf.len % 8 != 0 || exp_buf.len / 8 > MAX_LIMBS) {
        PyErr_Format(PyExc_ValueError, "exponent must be 8 * limbs bytes, at most %d limbs",
                     MAX_LIMBS);
        goto done;
    }
    if (bases_buf.len % (8 * s) != 0) {
        PyErr_Format(PyExc_ValueError, "bases: %zd bytes is not a whole number of %zd-byte values",
                     bases_buf.len, 8 * s);
        goto done;
    }
    const Py_ssize_t count = bases_buf.len / (8 * s), e_limbs = exp_buf.len / 8;
    load_limbs(e, exp_buf.buf, e_limbs);
    Py_ssize_t e_bits = 64 * e_limbs;
    while (e_bits > 0 && !((e[(e_bits - 1) >> 6] >> ((e_bits - 1) & 63)) & 1))
        e_bits--;
    /* an odd count gets a copy of its last base as the second of the last pair */
    values = aligned_block(sizeof(limb) * (size_t)((count + 1) * w));
    table = aligned_block(sizeof(limb) * (size_t)(2 * w) << POW_WINDOW);
    if (!values || !table) {
        PyErr_NoMemory();
        goto done;
    }
    if (load_residues(values, &bases_buf, count, c, "bases") < 0)
        goto done;
    if (count % 2)
        memcpy(values + count * w, values + (count - 1) * w, sizeof(limb) * (size_t)w);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i += 2)
        pow_pair(values + i * w, values + (i + 1) * w, e, e_bits, table, c);
    Py_END_ALLOW_THREADS
    result = PyBytes_FromStringAndSize(NULL, count * s * 8);
    if (result)
        for (Py_ssize_t i = 0; i < count; i++)
            store_residue((unsigned char *)PyBytes_AS_STRING(result) + i * s * 8, values + i * w,
                          c);
done:
    aligned_free(c);
    aligned_free(values);
    aligned_free(table);
    PyBuffer_Release(&modulus);
    PyBuffer_Release(&bases_buf);
    PyBuffer_Release(&exp_buf);
    return result;
}

/* ---------------------------------------------------------------- measurement */

static PyObject *mul_chain(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer modulus, a_buf, b_buf;
    Py_ssize_t count;
    int square, pair = 0;
    if (!PyArg_ParseTuple(args, "y*y*y*np|p", &modulus, &a_buf, &b_buf, &count, &square, &pair))
        return NULL;
    PyObject *result = NULL;
    mont_ctx *c = ctx_new(&modulus);
    limb a[MAX_WORDS] ALIGNED, b[MAX_WORDS] ALIGNED, a2[MAX_WORDS] ALIGNED;
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
    memcpy(a2, a, sizeof(limb) * (size_t)c->w);
    for (Py_ssize_t k = 0; k < count; k++) {
        if (pair && c->path == PATH_IFMA) /* a second, identical chain beside the first:
                                              * the interleaved product, at every size */
            c->ifma2(a, a, square ? a : b, a2, a2, square ? a2 : b, c);
        else if (pair)
            mont_mul2(a, a, square ? a : b, a2, a2, square ? a2 : b, c);
        else if (square)
            mont_sqr(a, a, c);
        else
            mont_mul(a, a, b, c);
    }
    if (pair && memcmp(a, a2, sizeof(limb) * (size_t)c->w) != 0)
        memset(a, 0, sizeof(limb) * (size_t)c->w); /* cannot happen: 0 fails every test */
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

static PyObject *product_path(PyObject *self, PyObject *args)
{
    (void)self;
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|z", &name))
        return NULL;
    PyObject *previous = PyUnicode_FromString(PATH_NAMES[current_path]);
    if (name == NULL || previous == NULL)
        return previous;
    for (int path = PATH_PORTABLE; path <= PATH_IFMA; path++)
        if (strcmp(name, PATH_NAMES[path]) == 0) {
            if (!path_supported(path)) {
                Py_DECREF(previous);
                PyErr_Format(PyExc_ValueError, "the %s product is not available on this CPU", name);
                return NULL;
            }
            current_path = path;
            return previous;
        }
    Py_DECREF(previous);
    PyErr_Format(PyExc_ValueError, "unknown product path %s (portable, avx2, ifma)", name);
    return NULL;
}

static PyObject *interleaves(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer modulus;
    if (!PyArg_ParseTuple(args, "y*", &modulus))
        return NULL;
    mont_ctx *c = ctx_new(&modulus);
    PyBuffer_Release(&modulus);
    if (!c)
        return NULL;
    const int pairs = c->interleave;
    aligned_free(c);
    return PyBool_FromLong(pairs);
}

static PyObject *supported_paths(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    PyObject *names = PyList_New(0);
    for (int path = PATH_PORTABLE; names && path <= PATH_IFMA; path++) {
        if (!path_supported(path))
            continue;
        PyObject *name = PyUnicode_FromString(PATH_NAMES[path]);
        if (!name || PyList_Append(names, name) < 0)
            Py_CLEAR(names);
        Py_XDECREF(name);
    }
    return names;
}

static PyMethodDef methods[] = {
    {"dense_multiexp", dense_multiexp, METH_VARARGS,
     "dense_multiexp(modulus, bases, exponents, windows) -> bytes\n\n"
     "prod_i bases[i]^exponents[i, j] mod modulus for every column j (bucket method)."},
    {"fixed_base_table", fixed_base_table, METH_VARARGS,
     "fixed_base_table(modulus, base, rows, window[, threads]) -> table\n\n"
     "Window table of a fixed base in Montgomery form (an opaque capsule), its rows shared "
     "among ``threads`` threads (the same entries whatever the number)."},
    {"fixed_base_products", fixed_base_products, METH_VARARGS,
     "fixed_base_products(table, digits) -> bytes\n\n"
     "prod_t table[t][digits[i, t]] for every row i of the int64 digit matrix."},
    {"powmod_fixed", powmod_fixed, METH_VARARGS,
     "powmod_fixed(modulus, bases, exponent) -> bytes\n\n"
     "bases[i]^exponent mod modulus for every base (one shared exponent, as in CRT "
     "decryption), two bases at a time through the interleaved product."},
    {"mul_chain", mul_chain, METH_VARARGS,
     "mul_chain(modulus, a, b, count, square[, pair]) -> bytes\n\n"
     "a * b^count (or a^(2^count) when square) by count Montgomery steps: for tests and "
     "benchmarks. With pair, two identical chains run through the interleaved product."},
    {"product_path", product_path, METH_VARARGS,
     "product_path([name]) -> str\n\n"
     "The product new contexts use (portable, avx2 or ifma; the fastest the CPU has, chosen at "
     "import); with a name, switch to it (ValueError where the CPU lacks it) and return the "
     "previous one."},
    {"interleaves", interleaves, METH_VARARGS,
     "interleaves(modulus) -> bool\n\n"
     "Whether the current path's loops run two products modulo ``modulus`` interleaved."},
    {"supported_paths", supported_paths, METH_NOARGS,
     "supported_paths() -> list\n\nThe products this build can run on this CPU."},
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
#endif
    for (int path = PATH_PORTABLE; path <= PATH_IFMA; path++)
        if (path_supported(path))
            current_path = path;
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "MAX_LIMBS", MAX_LIMBS) < 0 ||
              PyModule_AddIntConstant(m, "MAX_WINDOW", MAX_WINDOW) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
