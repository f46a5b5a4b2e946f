/* The K-quant formats (Q4_K, Q5_K, Q6_K) in gguf_linear.c's tiles: included by gguf_linear.c after its
 * activation rows, dot_accumulate and broadcast4, and driven by the same gemm_tiles, thread pool and entry.
 *
 * GGUF K-quants are super-blocks of 256 weights (ggml-quants' block_q4_K, block_q5_K, block_q6_K):
 *   Q4_K  144 B: d, dmin fp16; 8 sub-blocks of 32 with 6-bit scale sc and min m (12 packed bytes);
 *                qs[128]: byte 32p + l holds weight l of sub-block 2p (low nibble) and of 2p + 1 (high).
 *                w = d sc q - dmin m, q in 0..15.
 *   Q5_K  176 B: Q4_K plus qh[32]: bit s of qh[l] is the fifth bit of weight l of sub-block s; q in 0..31.
 *   Q6_K  210 B: ql[128], qh[64], 16 int8 scales (one per 16 weights), d fp16; in half h (128 weights) and
 *                quarter t (32 weights) weight l's low 4 bits are nibble t / 2 of ql[64h + 32 (t % 2) + l],
 *                its high 2 bits bits 2t, 2t + 1 of qh[32h + l]; w = d sc (q - 32), q in 0..63.
 *
 * The activations are gguf_linear.c's int8 blocks of 32 (one scale d_x per 32, and s_x = d_x sum q_x), so
 * each 32-weight sub-block is one activation block and its dot is as integer as Q4_1's:
 *   Q4_K, Q5_K  sum_j w_j x_j ~= (d sc) d_x idot - (dmin m) s_x   (per sub-block; d sc, dmin m exact in float)
 *   Q6_K        sum_j w_j x_j ~= d d_x [sc_a (idot_a - 32 S_a) + sc_b (idot_b - 32 S_b)]
 * where a, b are the two 16-weight halves of the activation block and S their int sums of q_x (the int32
 * bracket is exact: |.| < 2^26). Q8_K activations (one scale per 256) would let Q4_K/Q5_K sum sc idot in
 * integers too, at the price of a coarser rounding of x; the 32-blocks keep one activation format for all.
 *
 * Tile layout, per tile of 8 rows and per super-block (same values as the file; Q4_K/Q5_K's 6-bit scales and
 * mins are widened to a byte each, +32 B per 1152 or 1408, so a sub-block's 8 rows' scales are one load):
 *   Q4_K  d[8] fp16 | dmin[8] fp16 | sc[8 sub-blocks][8 rows] u8 | m[8][8] u8 | qs 1024 B          = 1184 B
 *   Q5_K  as Q4_K, then qh 256 B before qs                                                        = 1440 B
 *   Q6_K  d[8] fp16 | sc[16][8] s8 | ql 1024 B | qh 512 B                                        = 1680 B
 *   qs: for byte group p (0..3), 8 vectors of 32 B; vector v, lane i = row i's qs[32p + 4v .. 32p + 4v + 3].
 *   Q5_K qh: 8 vectors; vector v, lane i = row i's qh[4v .. 4v + 3].
 *   Q6_K ql: for half h and c (0, 1), 8 vectors; vector v, lane i = row i's ql[64h + 32c + 4v ..];
 *        qh: for half h, 8 vectors; vector v, lane i = row i's qh[32h + 4v ..].
 * So, as in the 32-weight formats, one vector holds 4 consecutive weights of each of the 8 rows.
 */

#define GGML_Q4_K 12
#define GGML_Q5_K 13
#define GGML_Q6_K 14
#define QK_K 256 /* weights per super-block */

#define KQ_MINS 96   /* Q4_K/Q5_K: offset of the mins (the scales start at 32, dmin at 16) */
#define KQ_QH 160    /* Q5_K */
#define KQ6_SCALES 16
#define KQ6_QL 144
#define KQ6_QH 1168

static inline int is_kquant(int type) { return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K; }

static int64_t kq_tile_block_bytes(int type) {
    switch (type) {
    case GGML_Q4_K: return 1184;
    case GGML_Q5_K: return 1440;
    case GGML_Q6_K: return 1680;
    default: return 0;
    }
}
static inline int kq_quants_offset(int type) { return type == GGML_Q5_K ? KQ_QH + 256 : KQ_QH; }

/* Byte of row i that holds weight l (0..31) of a 32-weight group whose 8 vectors start at `vectors`. */
static inline uint8_t lane_byte(const uint8_t *vectors, int i, int l) { return vectors[32 * (l / 4) + 4 * i + l % 4]; }

/* The unsigned code of weight j (0..255) of row i in a tile super-block: Q4_K 0..15, Q5_K 0..31, Q6_K 0..63. */
static inline int kq_code(int type, const uint8_t *blk, int i, int j) {
    const int t = j / 32, l = j % 32;
    if (type == GGML_Q6_K) {
        const int h = t / 4, quarter = t % 4;
        const uint8_t low = lane_byte(blk + KQ6_QL + 256 * (2 * h + quarter % 2), i, l);
        const uint8_t high = lane_byte(blk + KQ6_QH + 256 * h, i, l);
        return (quarter / 2 ? low >> 4 : low & 0x0f) | ((high >> (2 * quarter)) & 3) << 4;
    }
    const uint8_t byte = lane_byte(blk + kq_quants_offset(type) + 256 * (t / 2), i, l);
    const int code = t % 2 ? byte >> 4 : byte & 0x0f;
    return type == GGML_Q5_K ? code | ((lane_byte(blk + KQ_QH, i, l) >> t) & 1) << 4 : code;
}

/* Row i's weights of one tile super-block, dequantized (the quantized embedding's rows). */
static void kq_dequantize_block(int type, const uint8_t *blk, int i, float *o) {
    uint16_t halves[2 * TILE_N];
    memcpy(halves, blk, sizeof halves);
    const float d = half_to_float(halves[i]);
    for (int j = 0; j < QK_K; j++) {
        const int code = kq_code(type, blk, i, j);
        if (type == GGML_Q6_K) {
            o[j] = d * (float)((const int8_t *)(blk + KQ6_SCALES))[8 * (j / 16) + i] * (float)(code - 32);
        } else {
            const float scale = d * (float)blk[32 + 8 * (j / 32) + i];
            const float min = half_to_float(halves[TILE_N + i]) * (float)blk[KQ_MINS + 8 * (j / 32) + i];
            o[j] = scale * (float)code - min;
        }
    }
}

#if KL_SIMD
static inline __m256i low_nibbles(const uint8_t *p, int high) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)p), mask = _mm256_set1_epi8(0x0f);
    return _mm256_and_si256(high ? _mm256_srli_epi16(raw, 4) : raw, mask);
}

/* Bits of every byte of v moved left by `left` (right when negative), then masked: 16-bit shifts move bits
 * across the two bytes of a pair only into positions the mask clears. */
static inline __m256i shifted_bits(__m256i v, int left, char mask) {
    const __m256i s = left >= 0 ? _mm256_slli_epi16(v, left) : _mm256_srli_epi16(v, -left);
    return _mm256_and_si256(s, _mm256_set1_epi8(mask));
}

static inline __m256 bytes_to_floats(const uint8_t *p, int is_signed) {
    const __m128i raw = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw));
}

/* One tile (8 weight rows) in a K-quant format against rows [r0, r0 + MR) of x (as tile_rows). `type` is a
 * constant at the call site and the sub-block loop is unrolled, so each sub-block's nibble and bit shifts
 * are immediates (rolled, Q6_K's variable-count shifts ran at a third of the speed). */
static inline __attribute__((always_inline)) void kq_tile_rows(int type, const uint8_t *tile, const QuantizedRows *x,
                                                                int64_t r0, const int MR, float *out, int64_t ldo) {
    const int64_t nb = x->nb, tsb = kq_tile_block_bytes(type);
    __m256 acc[TILE_M];
    for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const uint8_t *blk = tile + sb * tsb;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const int64_t b = 8 * sb + t; /* the activation block */
            __m256i w[8];
            if (type == GGML_Q6_K) {
                const int h = t / 4, quarter = t % 4;
                for (int g = 0; g < 8; g++) {
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + KQ6_QH + 256 * h + 32 * g));
                    w[g] = _mm256_or_si256(low_nibbles(blk + KQ6_QL + 256 * (2 * h + quarter % 2) + 32 * g, quarter / 2),
                                           shifted_bits(qh, 4 - 2 * quarter, 0x30));
                }
                const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + KQ6_SCALES + 16 * t));
                const __m256i sc_a = _mm256_cvtepi8_epi32(sc), sc_b = _mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8));
                for (int r = 0; r < MR; r++) {
                    const int64_t row = r0 + r;
                    const int8_t *xq = x->q + row * x->k + b * QK;
                    __m256i ia = _mm256_setzero_si256(), ib = _mm256_setzero_si256();
                    ia = dot_groups(ia, w, xq, 4, 2);       /* 6-bit weights */
                    ib = dot_groups(ib, w + 4, xq + 16, 4, 2);
                    const int32_t *halves = x->sum16 + row * 2 * nb + 2 * b;
                    ia = _mm256_sub_epi32(ia, _mm256_set1_epi32(32 * halves[0]));
                    ib = _mm256_sub_epi32(ib, _mm256_set1_epi32(32 * halves[1]));
                    const __m256i isum = _mm256_add_epi32(_mm256_mullo_epi32(ia, sc_a), _mm256_mullo_epi32(ib, sc_b));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),
                                             _mm256_mul_ps(d, _mm256_set1_ps(x->d[row * nb + b])), acc[r]);
                }
                continue;
            }
            const __m256 scale = _mm256_mul_ps(d, bytes_to_floats(blk + 32 + 8 * t, 0));
            const __m256 min = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))),
                                             bytes_to_floats(blk + KQ_MINS + 8 * t, 0));
            const uint8_t *qs = blk + kq_quants_offset(type) + 256 * (t / 2);
            for (int g = 0; g < 8; g++) {
                w[g] = low_nibbles(qs + 32 * g, t % 2);
                if (type == GGML_Q5_K)
                    w[g] = _mm256_or_si256(w[g], shifted_bits(_mm256_loadu_si256((const __m256i *)(blk + KQ_QH + 32 * g)),
                                                              4 - t, 0x10));
            }
            for (int r = 0; r < MR; r++) {
                const int64_t row = r0 + r;
                const int8_t *xq = x->q + row * x->k + b * QK;
                __m256i idot = _mm256_setzero_si256();
                idot = dot_groups(idot, w, xq, 8, type == GGML_Q5_K ? 4 : 8);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot), _mm256_mul_ps(scale, _mm256_set1_ps(x->d[row * nb + b])),
                                         acc[r]);
                acc[r] = _mm256_fnmadd_ps(min, _mm256_set1_ps(x->s[row * nb + b]), acc[r]);
            }
        }
    }
    for (int r = 0; r < MR; r++) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

#ifdef KL_PAIR_TILES
static inline __m512i low_nibbles_pair(const uint8_t *a, const uint8_t *b, int high) {
    const __m512i raw = load_pair(a, b), mask = _mm512_set1_epi8(0x0f);
    return _mm512_and_si512(high ? _mm512_srli_epi16(raw, 4) : raw, mask);
}

static inline __m512i shifted_bits_pair(__m512i v, int left, char mask) {
    const __m512i s = left >= 0 ? _mm512_slli_epi16(v, left) : _mm512_srli_epi16(v, -left);
    return _mm512_and_si512(s, _mm512_set1_epi8(mask));
}

static inline __m512i broadcast4_pair(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* 8 bytes of each of two tiles as 16 int32 lanes (lanes 0-7: the first tile's rows). */
static inline __m512i bytes_pair(const uint8_t *a, const uint8_t *b, int is_signed) {
    const __m128i raw = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
    return is_signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
}

/* Two adjacent full K-quant tiles (16 rows) in 512-bit vectors, as tile_pair_rows does for the 32-weight
 * formats: every lane does kq_tile_rows' operations in its order, so the bits are the same. */
static inline __attribute__((always_inline)) void kq_tile_pair_rows(int type, const uint8_t *tile, int64_t tile_bytes,
                                                                     const QuantizedRows *x, int64_t r0, const int MR,
                                                                     float *out, int64_t ldo) {
    const int64_t nb = x->nb, tsb = kq_tile_block_bytes(type);
    __m512 acc[PAIR_M];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        const uint8_t *blk = tile + sb * tsb, *blk2 = tile + tile_bytes + sb * tsb;
        const __m512 d = halves_pair(blk, blk2);
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const int64_t b = 8 * sb + t;
            if (r0 == 0) prefetch_pair(tile, tile_bytes, sb * tsb + t * (tsb / 8), tsb / 8); /* an eighth a block */
            __m512i w[8];
            if (type == GGML_Q6_K) {
                const int h = t / 4, quarter = t % 4;
                for (int g = 0; g < 8; g++) {
                    const int64_t ql = KQ6_QL + 256 * (2 * h + quarter % 2) + 32 * g, qh = KQ6_QH + 256 * h + 32 * g;
                    w[g] = _mm512_or_si512(low_nibbles_pair(blk + ql, blk2 + ql, quarter / 2),
                                           shifted_bits_pair(load_pair(blk + qh, blk2 + qh), 4 - 2 * quarter, 0x30));
                }
                const int64_t sc = KQ6_SCALES + 16 * t;
                const __m512i sc_a = bytes_pair(blk + sc, blk2 + sc, 1), sc_b = bytes_pair(blk + sc + 8, blk2 + sc + 8, 1);
                for (int r = 0; r < MR; r++) {
                    const int64_t row = r0 + r;
                    const int8_t *xq = x->q + row * x->k + b * QK;
                    __m512i ia = _mm512_setzero_si512(), ib = _mm512_setzero_si512();
                    for (int g = 0; g < 4; g++) ia = _mm512_dpbusd_epi32(ia, w[g], broadcast4_pair(xq + 4 * g));
                    for (int g = 4; g < 8; g++) ib = _mm512_dpbusd_epi32(ib, w[g], broadcast4_pair(xq + 4 * g));
                    const int32_t *halves = x->sum16 + row * 2 * nb + 2 * b;
                    ia = _mm512_sub_epi32(ia, _mm512_set1_epi32(32 * halves[0]));
                    ib = _mm512_sub_epi32(ib, _mm512_set1_epi32(32 * halves[1]));
                    const __m512i isum = _mm512_add_epi32(_mm512_mullo_epi32(ia, sc_a), _mm512_mullo_epi32(ib, sc_b));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(x->d[row * nb + b])),
                                             acc[r]);
                }
                continue;
            }
            const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(bytes_pair(blk + 32 + 8 * t, blk2 + 32 + 8 * t, 0)));
            const __m512 min = _mm512_mul_ps(halves_pair(blk + 16, blk2 + 16),
                                             _mm512_cvtepi32_ps(bytes_pair(blk + KQ_MINS + 8 * t, blk2 + KQ_MINS + 8 * t, 0)));
            const int64_t qs = kq_quants_offset(type) + 256 * (t / 2);
            for (int g = 0; g < 8; g++) {
                w[g] = low_nibbles_pair(blk + qs + 32 * g, blk2 + qs + 32 * g, t % 2);
                if (type == GGML_Q5_K)
                    w[g] = _mm512_or_si512(w[g], shifted_bits_pair(load_pair(blk + KQ_QH + 32 * g, blk2 + KQ_QH + 32 * g),
                                                                   4 - t, 0x10));
            }
            for (int r = 0; r < MR; r++) {
                const int64_t row = r0 + r;
                const int8_t *xq = x->q + row * x->k + b * QK;
                /* Two chains of 4 (int32 sums are exact, so the same bits): one row's 8 dependent vpdpbusd
                 * were the one-row step's critical path, with the weights already in cache. */
                __m512i ia = _mm512_setzero_si512(), ib = _mm512_setzero_si512();
                for (int g = 0; g < 4; g++) {
                    ia = _mm512_dpbusd_epi32(ia, w[g], broadcast4_pair(xq + 4 * g));
                    ib = _mm512_dpbusd_epi32(ib, w[g + 4], broadcast4_pair(xq + 4 * g + 16));
                }
                const __m512i idot = _mm512_add_epi32(ia, ib);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot), _mm512_mul_ps(scale, _mm512_set1_ps(x->d[row * nb + b])),
                                         acc[r]);
                acc[r] = _mm512_fnmadd_ps(min, _mm512_set1_ps(x->s[row * nb + b]), acc[r]);
            }
        }
    }
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(out + r * ldo, acc[r]);
}
#endif
#else
static void kq_tile_rows(int type, const uint8_t *tile, const QuantizedRows *x, int64_t r0, const int MR, float *out,
                         int64_t ldo) {
    const int64_t nb = x->nb, tsb = kq_tile_block_bytes(type);
    for (int r = 0; r < MR; r++) {
        const int64_t row = r0 + r;
        for (int i = 0; i < TILE_N; i++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = tile + (b / 8) * tsb;
                const int t = (int)(b % 8);
                uint16_t halves[2 * TILE_N];
                memcpy(halves, blk, sizeof halves);
                const float d = half_to_float(halves[i]), dx = x->d[row * nb + b];
                const int8_t *xq = x->q + row * x->k + b * QK;
                int32_t idot[2] = {0, 0};
                for (int j = 0; j < QK; j++) idot[j / 16] += kq_code(type, blk, i, 32 * t + j) * xq[j];
                if (type == GGML_Q6_K) {
                    const int8_t *sc = (const int8_t *)(blk + KQ6_SCALES + 16 * t);
                    const int32_t *sums = x->sum16 + row * 2 * nb + 2 * b;
                    const int32_t isum = sc[i] * (idot[0] - 32 * sums[0]) + sc[8 + i] * (idot[1] - 32 * sums[1]);
                    acc += (float)isum * (d * dx);
                } else {
                    const float scale = d * (float)blk[32 + 8 * t + i];
                    const float min = half_to_float(halves[TILE_N + i]) * (float)blk[KQ_MINS + 8 * t + i];
                    acc += (float)(idot[0] + idot[1]) * (scale * dx);
                    acc -= min * x->s[row * nb + b];
                }
            }
            out[r * ldo + i] = acc;
        }
    }
}
#endif

/* ----------------------------------------------------------------------------------------------- packing */
/* A K-quant weight's rows [n, k / 256 * block bytes] in the layout above (kl_gguf_pack's K-quant half). */
static void kq_pack(int type, const uint8_t *rows, int64_t n, int64_t k, uint8_t *tiles) {
    static const uint8_t zero_block[210];
    const int64_t tsb = kq_tile_block_bytes(type), sbs = k / QK_K;
    const int64_t bb = type == GGML_Q4_K ? 144 : type == GGML_Q5_K ? 176 : 210;
    for (int64_t t = 0; t < (n + TILE_N - 1) / TILE_N; t++) {
        for (int64_t sb = 0; sb < sbs; sb++) {
            uint8_t *dst = tiles + (t * sbs + sb) * tsb;
            for (int i = 0; i < TILE_N; i++) {
                const int64_t r = t * TILE_N + i;
                const uint8_t *src = r < n ? rows + (r * sbs + sb) * bb : zero_block;
                if (type == GGML_Q6_K) {
                    memcpy(dst + 2 * i, src + 208, 2);
                    for (int s = 0; s < 16; s++) dst[KQ6_SCALES + 8 * s + i] = src[192 + s];
                    for (int h = 0; h < 2; h++)
                        for (int v = 0; v < 8; v++) {
                            for (int c = 0; c < 2; c++)
                                memcpy(dst + KQ6_QL + 256 * (2 * h + c) + 32 * v + 4 * i, src + 64 * h + 32 * c + 4 * v, 4);
                            memcpy(dst + KQ6_QH + 256 * h + 32 * v + 4 * i, src + 128 + 32 * h + 4 * v, 4);
                        }
                    continue;
                }
                memcpy(dst + 2 * i, src, 2);
                memcpy(dst + 16 + 2 * i, src + 2, 2);
                const uint8_t *sc = src + 4; /* 6-bit scales and mins, packed as ggml-quants' get_scale_min_k4 reads */
                for (int s = 0; s < 8; s++) {
                    dst[32 + 8 * s + i] = s < 4 ? sc[s] & 63 : (sc[s + 4] & 0x0f) | (sc[s - 4] >> 6) << 4;
                    dst[KQ_MINS + 8 * s + i] = s < 4 ? sc[s + 4] & 63 : (sc[s + 4] >> 4) | (sc[s] >> 6) << 4;
                }
                const uint8_t *qs = src + (type == GGML_Q5_K ? 48 : 16);
                for (int v = 0; v < 8; v++) {
                    if (type == GGML_Q5_K) memcpy(dst + KQ_QH + 32 * v + 4 * i, src + 16 + 4 * v, 4);
                    for (int p = 0; p < 4; p++)
                        memcpy(dst + kq_quants_offset(type) + 256 * p + 32 * v + 4 * i, qs + 32 * p + 4 * v, 4);
                }
            }
        }
    }
}
