// Runs Kev's Metal kernels (the unchanged .metal sources) on the CPU through metal_stdlib_emu.h
// and compares them with double-precision loops written here. Prints one line per comparison
// and exits non-zero if any is beyond its tolerance. Built and run by tests/metal_emulated.rs:
//
//   clang++ -std=c++20 -O1 -Wno-unknown-attributes -Wno-register -I tests/metal_emu/include \
//       tests/metal_emu/run_kernels.cpp -o run_kernels && ./run_kernels [--seed N]
//
// The launches mirror src/<op>/metal.rs: entry point names, variant choice (NK, the chunked kernel's
// Dk), grid and threadgroup sizes, threadgroup memory, and the parameter structs.

#include "metal_stdlib_emu.h"

#include <chrono>

#include <sys/wait.h>
#include <unistd.h>

// Each source in its own namespace: both define the same small dtype helpers.
namespace gdr {
#include "../../src/gated_delta_rule/gated_delta_rule.metal"
}
namespace conv {
#include "../../src/causal_conv1d/causal_conv1d.metal"
}
namespace norm {
#include "../../src/norm/norm.metal"
}
namespace gates {
#include "../../src/gates/gates.metal"
}
namespace swiglu {
#include "../../src/swiglu/swiglu.metal"
}
namespace attn {
#include "../../src/attention/attention.metal"
}
namespace flash {
#include "../../src/flash_attention/flash_attention.metal"
}
namespace gather {
#include "../../src/gather/gather.metal"
}

// ---------------------------------------------------------------- the host's launch constants
// (src/gated_delta_rule/metal.rs: GDR_COLUMNS_PER_GROUP, SIMD_WIDTH, GDR_MAX_DK; src/causal_conv1d/metal.rs: CONV_THREADS_PER_GROUP)
constexpr uint GDR_COLS = 4;
constexpr uint SIMD_W = 32;
constexpr uint CONV_THREADS = 256;
constexpr uint GDR_MAX_DK = 256;
// src/gated_delta_rule/metal.rs: CHUNKED_COLUMNS_PER_GROUP, CHUNKED_MAX_HEAD_K_DIM; op.rs:
// METAL_CHUNKED_MIN_LEN; and the kernel's own GDRC_CHUNK.
constexpr uint GDRC_COLS = 32;
constexpr uint GDRC_MAX_DK = 128;
constexpr uint GDR_METAL_CHUNKED_MIN_LEN = 64;
static_assert(gdr::GDRC_CHUNK == 16, "the chunk length the host sizes threadgroup memory for");

// The Rust side declares the same #[repr(C)] layouts and asserts their sizes.
static_assert(sizeof(gdr::GdrParams) == 32, "GdrParams layout");
static_assert(sizeof(conv::ConvParams) == 16, "ConvParams layout");

static uint gdr_nk(uint dk) {
    for (uint nk : {1u, 2u, 4u, 8u}) {
        if (dk <= SIMD_W * nk) return nk;
    }
    emu::fail("Dk above the largest variant");
}

// ---------------------------------------------------------------- dtypes
static ushort bf16_from(float x) {
    uint u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return ushort((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return ushort(u >> 16);
}
static float bf16_to(ushort x) {
    uint u = uint(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

template <class T> struct Dt;
template <> struct Dt<float> {
    static constexpr const char* name = "f32";
    static float from(float x) { return x; }
    static double to(float x) { return x; }
    static constexpr double rel = 0.0; // output rounding, relative
};
template <> struct Dt<ushort> {
    static constexpr const char* name = "bf16";
    static ushort from(float x) { return bf16_from(x); }
    static double to(ushort x) { return bf16_to(x); }
    static constexpr double rel = 1.0 / 256; // half an ulp of 8 significant bits
};
template <> struct Dt<half> {
    static constexpr const char* name = "f16";
    static half from(float x) { return half(x); }
    static double to(half x) { return double(float(x)); }
    static constexpr double rel = 1.0 / 2048; // half an ulp of 11 significant bits
};

// ---------------------------------------------------------------- guarded buffers
// GUARD elements on each side are filled with all-ones bytes (a NaN for floats), as is the body
// before a kernel writes it: an out-of-bounds write shows as a changed guard, a read of one or of
// an unwritten element as a NaN in the results.
template <class T> struct Buf {
    static constexpr size_t GUARD = 64;
    std::vector<T> v;
    size_t n;
    explicit Buf(size_t n_) : v(n_ + 2 * GUARD), n(n_) {
        std::memset(static_cast<void*>(v.data()), 0xFF, v.size() * sizeof(T));
    }
    T* data() { return v.data() + GUARD; }
    T& operator[](size_t i) { return v[GUARD + i]; }
    void check(const std::string& what) const {
        const unsigned char* bytes = reinterpret_cast<const unsigned char*>(v.data());
        const size_t body = n * sizeof(T), guard = GUARD * sizeof(T);
        for (size_t i = 0; i < guard; ++i) {
            if (bytes[i] != 0xFF || bytes[guard + body + i] != 0xFF) {
                emu::fail(what + ": out-of-bounds write next to the buffer");
            }
        }
    }
};

// ---------------------------------------------------------------- comparisons
static int g_failures = 0;

/// max |got − ref| against `abs_tol + rel_tol·|ref|`; NaNs count as failures.
static void compare(const std::string& what, const std::vector<double>& got,
                    const std::vector<double>& ref, double abs_tol, double rel_tol) {
    if (got.size() != ref.size()) emu::fail(what + ": size mismatch");
    double worst = 0, worst_ratio = 0;
    size_t at = 0, nans = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(got[i]) || std::isnan(ref[i])) {
            ++nans;
            continue;
        }
        const double d = std::fabs(got[i] - ref[i]);
        const double ratio = d / (abs_tol + rel_tol * std::fabs(ref[i]));
        if (d > worst) worst = d;
        if (ratio > worst_ratio) {
            worst_ratio = ratio;
            at = i;
        }
    }
    const bool ok = nans == 0 && worst_ratio <= 1.0;
    std::printf("%-58s max|d| = %.2e  worst d/tol = %.2f at %zu (got %.7g, ref %.7g)  NaNs %zu  %s\n",
                what.c_str(), worst, worst_ratio, at, got.empty() ? 0.0 : got[at],
                ref.empty() ? 0.0 : ref[at], nans, ok ? "ok" : "FAIL");
    if (!ok) ++g_failures;
}

static void expect_identical(const std::string& what, const std::vector<double>& a,
                             const std::vector<double>& b) {
    const bool ok = a.size() == b.size() &&
                    std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
    std::printf("%-58s %s\n", (what + ": bit-identical").c_str(), ok ? "ok" : "FAIL");
    if (!ok) ++g_failures;
}

// Deterministic unit-scale data, as tests/ops.rs: a patterned sine.
static std::vector<float> patterned(size_t n, float salt, float scale) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = std::sin(float(i) * 0.7311f + salt) * scale;
    return v;
}

// ---------------------------------------------------------------- gated delta rule
struct GdrShape {
    uint b, t, hk, hv, dk, dv;
    uint channels() const { return 2 * hk * dk + hv * dv; }
};

struct GdrData {
    std::vector<float> qkv;  // before rounding to the input dtype
    std::vector<float> gb;   // [B, T, Hv, 2]
    std::vector<float> state;
};

static GdrData gdr_data(const GdrShape& s, float salt) {
    GdrData d;
    d.qkv = patterned(size_t(s.b) * s.t * s.channels(), salt, 1.0f);
    const auto g = patterned(size_t(s.b) * s.t * s.hv, salt + 1.0f, 1.0f);
    const auto be = patterned(size_t(s.b) * s.t * s.hv, salt + 2.0f, 3.0f);
    d.gb.resize(g.size() * 2);
    for (size_t i = 0; i < g.size(); ++i) {
        d.gb[2 * i] = -2.0f * std::fabs(g[i]);                // log decay in [−2, 0]
        d.gb[2 * i + 1] = 1.0f / (1.0f + std::exp(-be[i]));   // β in (0, 1)
    }
    d.state = patterned(size_t(s.b) * s.hv * s.dk * s.dv, salt + 3.0f, 0.5f);
    return d;
}

/// The recurrence in double, on the inputs exactly as the kernel sees them.
static void gdr_ref(const GdrShape& s, const std::vector<double>& qkv, const std::vector<float>& gb,
                    const std::vector<uint>& lengths, std::vector<double>& S, std::vector<double>& o) {
    const uint C = s.channels(), group = s.hv / s.hk;
    o.assign(size_t(s.b) * s.t * s.hv * s.dv, 0.0);
    std::vector<double> q(s.dk), k(s.dk), kv(s.dv);
    for (uint b = 0; b < s.b; ++b)
        for (uint h = 0; h < s.hv; ++h) {
            const uint kh = h / group;
            double* st = &S[(size_t(b) * s.hv + h) * s.dk * s.dv];
            for (uint t = 0; t < std::min(lengths[b], s.t); ++t) {
                const double* row = &qkv[(size_t(b) * s.t + t) * C];
                double qq = 0, kk = 0;
                for (uint i = 0; i < s.dk; ++i) {
                    q[i] = row[kh * s.dk + i];
                    k[i] = row[(s.hk + kh) * s.dk + i];
                    qq += q[i] * q[i];
                    kk += k[i] * k[i];
                }
                const double qs = 1.0 / std::sqrt(double(s.dk)) / std::sqrt(qq + 1e-6);
                const double ks = 1.0 / std::sqrt(kk + 1e-6);
                const float* gate = &gb[((size_t(b) * s.t + t) * s.hv + h) * 2];
                const double decay = std::exp(double(gate[0])), beta = gate[1];
                for (uint j = 0; j < s.dv; ++j) kv[j] = 0;
                for (uint i = 0; i < s.dk; ++i)
                    for (uint j = 0; j < s.dv; ++j) {
                        st[i * s.dv + j] *= decay;
                        kv[j] += st[i * s.dv + j] * k[i] * ks;
                    }
                for (uint j = 0; j < s.dv; ++j) {
                    const double delta = beta * (row[2 * s.hk * s.dk + h * s.dv + j] - kv[j]);
                    double acc = 0;
                    for (uint i = 0; i < s.dk; ++i) {
                        st[i * s.dv + j] += k[i] * ks * delta;
                        acc += st[i * s.dv + j] * q[i] * qs;
                    }
                    o[((size_t(b) * s.t + t) * s.hv + h) * s.dv + j] = acc;
                }
            }
        }
}

template <class T> struct GdrEntries;
#define GDR_TABLE(TN, T)                                                                       \
    template <> struct GdrEntries<T> {                                                         \
        using Fn = decltype(&gdr::gated_delta_rule_##TN##_nk1);                                \
        static Fn get(uint nk) {                                                               \
            switch (nk) {                                                                      \
            case 1: return gdr::gated_delta_rule_##TN##_nk1;                                   \
            case 2: return gdr::gated_delta_rule_##TN##_nk2;                                   \
            case 4: return gdr::gated_delta_rule_##TN##_nk4;                                   \
            case 8: return gdr::gated_delta_rule_##TN##_nk8;                                   \
            }                                                                                  \
            emu::fail("no gated_delta_rule variant for NK " + std::to_string(nk));             \
        }                                                                                      \
    };
GDR_TABLE(f32, float)
GDR_TABLE(bf16, ushort)
GDR_TABLE(f16, half)

/// The chunked kernel's Dk variant: the smallest of 32, 64, 128 holding Dk (metal.rs).
static uint gdrc_dk_variant(uint dk) {
    for (uint v : {32u, 64u, 128u}) {
        if (dk <= v) return v;
    }
    emu::fail("Dk above the chunked kernel's largest variant");
}

/// Threadgroup memory of the chunked kernel, as metal.rs sizes it: q̂ and k̂ tiles [C][DKP], five
/// C×C matrices, eight gate rows of C, a [C][8] staging tile per simdgroup; f32.
static size_t gdrc_threadgroup_bytes(uint dkp, uint simdgroups) {
    const size_t c = gdr::GDRC_CHUNK;
    return 4 * (2 * c * dkp + 5 * c * c + 8 * c + simdgroups * c * 8);
}

template <class T> struct GdrcEntries;
#define GDRC_TABLE(TN, T)                                                                      \
    template <> struct GdrcEntries<T> {                                                        \
        using Fn = decltype(&gdr::gated_delta_rule_chunked_##TN##_dk32);                       \
        static Fn get(uint dkp) {                                                              \
            switch (dkp) {                                                                     \
            case 32: return gdr::gated_delta_rule_chunked_##TN##_dk32;                         \
            case 64: return gdr::gated_delta_rule_chunked_##TN##_dk64;                         \
            case 128: return gdr::gated_delta_rule_chunked_##TN##_dk128;                       \
            }                                                                                  \
            emu::fail("no gated_delta_rule_chunked variant for Dk " + std::to_string(dkp));    \
        }                                                                                      \
    };
GDRC_TABLE(f32, float)
GDRC_TABLE(bf16, ushort)
GDRC_TABLE(f16, half)

/// Which kernel a launch runs, as metal.rs's `GdrForm` (not named `kernel`: the header's macro).
enum class GdrKernel { Recurrent, Chunked, Auto };

/// metal.rs's choice for `GdrForm::Auto`: the chunked kernel from METAL_CHUNKED_MIN_LEN steps on
/// for bf16 and f16 inputs with Dk ≤ 128; f32 and shorter calls step by step.
template <class T> static bool gdr_auto_chunked(const GdrShape& s) {
    return !std::is_same_v<T, float> && s.t >= GDR_METAL_CHUNKED_MIN_LEN && s.dk <= GDRC_MAX_DK;
}

struct GdrOut {
    std::vector<double> qkv_seen; // the input as the kernel read it (rounded to T)
    std::vector<double> o;
    std::vector<double> state;
    bool chunked = false; // which kernel ran
};

/// One launch as src/<op>/metal.rs makes it. `state` is read and updated in place.
template <class T>
static GdrOut gdr_emu(const GdrShape& s, const std::vector<float>& qkv_f, const std::vector<float>& gb_f,
                      std::vector<float>& state, const std::vector<uint>& lengths_in,
                      GdrKernel form = GdrKernel::Recurrent) {
    if (s.dk > GDR_MAX_DK) emu::fail("Dk too large");
    const bool chunked = form == GdrKernel::Chunked ||
                         (form == GdrKernel::Auto && gdr_auto_chunked<T>(s));
    if (chunked && s.dk > GDRC_MAX_DK) emu::fail("Dk too large for the chunked kernel");
    const std::string tag = std::string(chunked ? "gated_delta_rule_chunked_" : "gated_delta_rule_") +
                            Dt<T>::name;
    Buf<T> qkv(qkv_f.size());
    Buf<float> gb(gb_f.size()), st(state.size());
    Buf<T> o(size_t(s.b) * s.t * s.hv * s.dv);
    Buf<uint> lengths(s.b);
    GdrOut out;
    out.chunked = chunked;
    for (size_t i = 0; i < qkv_f.size(); ++i) {
        qkv[i] = Dt<T>::from(qkv_f[i]);
        out.qkv_seen.push_back(Dt<T>::to(qkv[i]));
    }
    std::copy(gb_f.begin(), gb_f.end(), gb.data());
    std::copy(state.begin(), state.end(), st.data());
    std::copy(lengths_in.begin(), lengths_in.end(), lengths.data());
    const gdr::GdrParams p{s.b, s.t, s.hk, s.hv, s.dk, s.dv, 1.0f / std::sqrt(float(s.dk)), 1e-6f};
    if (chunked) {
        const uint dkp = gdrc_dk_variant(s.dk), simdgroups = GDRC_COLS / 8;
        const auto fn = GdrcEntries<T>::get(dkp);
        const uint3 groups = {(s.dv + GDRC_COLS - 1) / GDRC_COLS, s.hv, s.b};
        const uint3 tg = {SIMD_W * simdgroups, 1, 1};
        emu::dispatch_thread_groups(
            groups, tg,
            [&](const emu::Ids& id) {
                fn(qkv.data(), gb.data(), st.data(), o.data(), lengths.data(), p,
                   reinterpret_cast<float*>(id.threadgroup_memory), id.threadgroup_position_in_grid,
                   id.simdgroup_index_in_threadgroup, id.simdgroups_per_threadgroup,
                   id.thread_index_in_simdgroup);
            },
            gdrc_threadgroup_bytes(dkp, simdgroups));
    } else {
        const auto fn = GdrEntries<T>::get(gdr_nk(s.dk));
        const uint3 groups = {(s.dv + GDR_COLS - 1) / GDR_COLS, s.hv, s.b};
        const uint3 tg = {SIMD_W * GDR_COLS, 1, 1};
        emu::dispatch_thread_groups(groups, tg, [&](const emu::Ids& id) {
            fn(qkv.data(), gb.data(), st.data(), o.data(), lengths.data(), p,
               id.threadgroup_position_in_grid, id.simdgroup_index_in_threadgroup,
               id.simdgroups_per_threadgroup, id.thread_index_in_simdgroup);
        });
    }
    qkv.check(tag + " qkv");
    gb.check(tag + " gb");
    st.check(tag + " state");
    o.check(tag + " o");
    lengths.check(tag + " lengths");
    for (size_t i = 0; i < o.n; ++i) out.o.push_back(Dt<T>::to(o[i]));
    for (size_t i = 0; i < st.n; ++i) {
        state[i] = st[i];
        out.state.push_back(st[i]);
    }
    return out;
}

/// The kernel against the double loop, on output and final state.
template <class T>
static GdrOut gdr_case(const std::string& name, const GdrShape& s, const std::vector<uint>& lengths,
                       float salt) {
    const GdrData d = gdr_data(s, salt);
    std::vector<float> state = d.state;
    GdrOut got = gdr_emu<T>(s, d.qkv, d.gb, state, lengths);
    std::vector<double> S(d.state.begin(), d.state.end()), o;
    gdr_ref(s, got.qkv_seen, d.gb, lengths, S, o);
    // f32 arithmetic against double on unit-scale data; the output is then rounded to T once.
    compare(name + " output", got.o, o, 1e-5, Dt<T>::rel);
    compare(name + " state", got.state, S, 1e-5, 0.0);
    return got;
}

static void gdr_tests(uint64_t seed) {
    // T = 1 (decode), one head.
    gdr_case<float>("gdr f32 T=1 B=1 Hk=Hv=1 Dk=32 Dv=16", {1, 1, 1, 1, 32, 16}, {1}, 0.3f);
    // T = 37, Hv = 2·Hk, B = 2 with lengths [T, T−5]: the test model's head sizes.
    const GdrShape main_shape{2, 37, 1, 2, 32, 16};
    const std::vector<uint> main_len{37, 32};
    const GdrOut whole = gdr_case<float>("gdr f32 T=37 B=2 len=[37,32] Hk=1 Hv=2 Dk=32 Dv=16",
                                         main_shape, main_len, 0.7f);
    {
        // Steps past a row's length: the output is exactly zero.
        bool zero = true;
        for (uint t = 32; t < 37; ++t)
            for (uint h = 0; h < 2; ++h)
                for (uint j = 0; j < 16; ++j)
                    zero &= whole.o[((size_t(1) * 37 + t) * 2 + h) * 16 + j] == 0.0;
        std::printf("%-58s %s\n", "gdr padded steps output exactly 0", zero ? "ok" : "FAIL");
        g_failures += !zero;
    }
    // Two chunks (20 + 17 steps, lengths relative to each chunk) == the whole sequence, exactly.
    {
        const GdrData d = gdr_data(main_shape, 0.7f);
        const uint cut = 20, C = main_shape.channels(), hv = main_shape.hv;
        std::vector<float> state = d.state;
        std::vector<double> o(whole.o.size());
        for (uint part = 0; part < 2; ++part) {
            const uint t0 = part ? cut : 0, tn = part ? 37 - cut : cut;
            GdrShape s = main_shape;
            s.t = tn;
            std::vector<float> qkv, gb;
            for (uint b = 0; b < s.b; ++b) {
                qkv.insert(qkv.end(), d.qkv.begin() + (size_t(b) * 37 + t0) * C,
                           d.qkv.begin() + (size_t(b) * 37 + t0 + tn) * C);
                gb.insert(gb.end(), d.gb.begin() + (size_t(b) * 37 + t0) * hv * 2,
                          d.gb.begin() + (size_t(b) * 37 + t0 + tn) * hv * 2);
            }
            std::vector<uint> len;
            for (uint l : main_len) len.push_back(std::min(tn, l > t0 ? l - t0 : 0));
            const GdrOut r = gdr_emu<float>(s, qkv, gb, state, len);
            for (uint b = 0; b < s.b; ++b)
                std::copy(r.o.begin() + size_t(b) * tn * hv * 16,
                          r.o.begin() + size_t(b + 1) * tn * hv * 16,
                          o.begin() + (size_t(b) * 37 + t0) * hv * 16);
        }
        expect_identical("gdr two chunks (20+17) == whole: output", o, whole.o);
        expect_identical("gdr two chunks (20+17) == whole: state",
                         std::vector<double>(state.begin(), state.end()), whole.state);
    }
    // Input dtypes: compared with the double loop fed the same rounded inputs.
    gdr_case<ushort>("gdr bf16 T=13 B=2 len=[13,8] Hk=1 Hv=2 Dk=32 Dv=16", {2, 13, 1, 2, 32, 16},
                     {13, 8}, 0.9f);
    gdr_case<half>("gdr f16 T=9 B=2 len=[9,4] Hk=1 Hv=2 Dk=32 Dv=16", {2, 9, 1, 2, 32, 16}, {9, 4},
                   1.3f);
    // Several key heads, Hv = 2·Hk.
    gdr_case<float>("gdr f32 T=6 B=1 Hk=2 Hv=4 Dk=32 Dv=16", {1, 6, 2, 4, 32, 16}, {6}, 1.9f);
    // Other NK variants: Dk = 128 (real models), a Dk that is no multiple of 32, the largest Dk;
    // Dv not a multiple of the columns per threadgroup (whole simdgroups return early).
    gdr_case<float>("gdr f32 T=5 B=1 Hk=1 Hv=2 Dk=128 Dv=8", {1, 5, 1, 2, 128, 8}, {5}, 2.3f);
    gdr_case<float>("gdr f32 T=7 B=1 Hk=1 Hv=1 Dk=48 Dv=6", {1, 7, 1, 1, 48, 6}, {7}, 2.9f);
    gdr_case<float>("gdr f32 T=3 B=1 Hk=1 Hv=1 Dk=256 Dv=5", {1, 3, 1, 1, 256, 5}, {3}, 3.1f);
    // Shuffled schedule (threadgroup order and fiber resume order): bit-identical results.
    {
        const GdrShape s{2, 9, 1, 2, 48, 6};
        const GdrData d = gdr_data(s, 4.1f);
        std::vector<float> st_a = d.state, st_b = d.state;
        const GdrOut a = gdr_emu<float>(s, d.qkv, d.gb, st_a, {9, 7});
        emu::options() = {true, seed};
        const GdrOut b = gdr_emu<float>(s, d.qkv, d.gb, st_b, {9, 7});
        emu::options() = {};
        expect_identical("gdr shuffled schedule == in order: output", a.o, b.o);
        expect_identical("gdr shuffled schedule == in order: state", a.state, b.state);
    }
}

// ---------------------------------------------------------------- gated delta rule, chunked
// f32 tolerance of the chunked kernel, against the double loop and against the recurrent
// kernel: absolute, on unit-scale data, plus relative to |ref|.
constexpr double GDRC_ABS = 1e-6;
constexpr double GDRC_REL = 1e-6;

/// Outputs of steps at or past a row's length must be exactly 0.
static void gdr_expect_padding_zero(const std::string& name, const GdrShape& s,
                                    const std::vector<uint>& lengths, const std::vector<double>& o) {
    bool zero = true;
    for (uint b = 0; b < s.b; ++b)
        for (uint t = std::min(lengths[b], s.t); t < s.t; ++t)
            for (size_t i = 0; i < size_t(s.hv) * s.dv; ++i)
                zero &= o[(size_t(b) * s.t + t) * s.hv * s.dv + i] == 0.0;
    std::printf("%-58s %s\n", (name + ": padded steps output exactly 0").c_str(), zero ? "ok" : "FAIL");
    g_failures += !zero;
}

/// A launch (the chunked kernel, or the dispatch's choice) against the double loop, on output and
/// final state; where the chunked kernel ran, also against the recurrent kernel on the same
/// inputs and initial state.
template <class T>
static GdrOut gdrc_case(const std::string& name, const GdrShape& s, const std::vector<uint>& lengths,
                        float salt, GdrKernel form = GdrKernel::Chunked) {
    const GdrData d = gdr_data(s, salt);
    std::vector<float> state = d.state;
    GdrOut got = gdr_emu<T>(s, d.qkv, d.gb, state, lengths, form);
    std::vector<double> S(d.state.begin(), d.state.end()), o;
    gdr_ref(s, got.qkv_seen, d.gb, lengths, S, o);
    const std::string label = name + (got.chunked ? " chunked" : " recurrent");
    // f32 products against double; the output then rounded to T once.
    compare(label + " output", got.o, o, GDRC_ABS, GDRC_REL + Dt<T>::rel);
    compare(label + " state", got.state, S, GDRC_ABS, GDRC_REL);
    gdr_expect_padding_zero(label, s, lengths, got.o);
    if (got.chunked) {
        std::vector<float> state_rec = d.state;
        const GdrOut rec = gdr_emu<T>(s, d.qkv, d.gb, state_rec, lengths, GdrKernel::Recurrent);
        // Each rounded to T once: one full ulp apart at most, beyond the f32 difference.
        compare(label + " vs recurrent: output", got.o, rec.o, GDRC_ABS, GDRC_REL + 2 * Dt<T>::rel);
        compare(label + " vs recurrent: state", got.state, rec.state, GDRC_ABS, GDRC_REL);
    }
    return got;
}

static void gdrc_tests(uint64_t seed) {
    // Lengths no multiple of the 16-step chunk, a padded row, Hv = 2·Hk, the initial state nonzero.
    const GdrShape main_shape{2, 37, 1, 2, 32, 16};
    const std::vector<uint> main_len{37, 30};
    const GdrOut whole = gdrc_case<float>("gdrc f32 T=37 B=2 len=[37,30] Hk=1 Hv=2 Dk=32 Dv=16",
                                          main_shape, main_len, 0.7f);
    // Several key heads, Dk = 128 (the models'), Dv = 40: one live slab of 8 columns in the second
    // threadgroup, three simdgroups past Dv.
    gdrc_case<float>("gdrc f32 T=40 B=1 Hk=2 Hv=4 Dk=128 Dv=40", {1, 40, 2, 4, 128, 40}, {40}, 1.9f);
    // Dk no multiple of 8 (the 64 variant, zero features), Dv = 6, a row of length 0, one step.
    gdrc_case<float>("gdrc f32 T=21 B=3 len=[21,0,1] Hk=1 Hv=1 Dk=44 Dv=6", {3, 21, 1, 1, 44, 6},
                     {21, 0, 1}, 2.9f);
    // Input dtypes.
    gdrc_case<ushort>("gdrc bf16 T=33 B=2 len=[33,17] Hk=1 Hv=2 Dk=64 Dv=16", {2, 33, 1, 2, 64, 16},
                      {33, 17}, 0.9f);
    gdrc_case<half>("gdrc f16 T=20 B=2 len=[20,9] Hk=2 Hv=2 Dk=32 Dv=8", {2, 20, 2, 2, 32, 8},
                    {20, 9}, 1.3f);
    // The dispatch's choice around METAL_CHUNKED_MIN_LEN: bf16 one step below (recurrent) and at
    // it (chunked); f32 at it stays recurrent.
    {
        const uint n = GDR_METAL_CHUNKED_MIN_LEN;
        const GdrShape below{2, n - 1, 1, 2, 32, 16}, at{2, n, 1, 2, 32, 16};
        const GdrOut lo = gdrc_case<ushort>("gdr auto bf16 T=MIN_LEN-1", below, {n - 1, n - 9}, 3.3f,
                                            GdrKernel::Auto);
        const GdrOut hi = gdrc_case<ushort>("gdr auto bf16 T=MIN_LEN", at, {n, n - 9}, 3.3f,
                                            GdrKernel::Auto);
        const GdrOut f32 = gdrc_case<float>("gdr auto f32 T=MIN_LEN", at, {n, n - 9}, 3.7f,
                                            GdrKernel::Auto);
        const bool ok = !lo.chunked && hi.chunked && !f32.chunked;
        std::printf("%-58s %s\n", "gdr auto: recurrent below MIN_LEN and for f32, chunked at it",
                    ok ? "ok" : "FAIL");
        g_failures += !ok;
    }
    // Two calls split at a chunk boundary (32 + 5 steps, the state carried over) == the whole
    // call, exactly: the same chunks, the same products.
    {
        const GdrData d = gdr_data(main_shape, 0.7f);
        const uint cut = 32, T = main_shape.t, C = main_shape.channels(), hv = main_shape.hv;
        const uint dv = main_shape.dv;
        std::vector<float> state = d.state;
        std::vector<double> o(whole.o.size());
        for (uint part = 0; part < 2; ++part) {
            const uint t0 = part ? cut : 0, tn = part ? T - cut : cut;
            GdrShape s = main_shape;
            s.t = tn;
            std::vector<float> qkv, gb;
            for (uint b = 0; b < s.b; ++b) {
                qkv.insert(qkv.end(), d.qkv.begin() + (size_t(b) * T + t0) * C,
                           d.qkv.begin() + (size_t(b) * T + t0 + tn) * C);
                gb.insert(gb.end(), d.gb.begin() + (size_t(b) * T + t0) * hv * 2,
                          d.gb.begin() + (size_t(b) * T + t0 + tn) * hv * 2);
            }
            std::vector<uint> len;
            for (uint l : main_len) len.push_back(std::min(tn, l > t0 ? l - t0 : 0));
            const GdrOut r = gdr_emu<float>(s, qkv, gb, state, len, GdrKernel::Chunked);
            for (uint b = 0; b < s.b; ++b)
                std::copy(r.o.begin() + size_t(b) * tn * hv * dv, r.o.begin() + size_t(b + 1) * tn * hv * dv,
                          o.begin() + (size_t(b) * T + t0) * hv * dv);
        }
        expect_identical("gdrc two calls (32+5) == whole: output", o, whole.o);
        expect_identical("gdrc two calls (32+5) == whole: state",
                         std::vector<double>(state.begin(), state.end()), whole.state);
    }
    // Shuffled schedule (threadgroup order and fiber resume order): bit-identical results, which
    // a missing threadgroup barrier would break.
    {
        const GdrShape s{2, 19, 1, 2, 48, 20};
        const GdrData d = gdr_data(s, 4.1f);
        std::vector<float> st_a = d.state, st_b = d.state;
        const GdrOut a = gdr_emu<float>(s, d.qkv, d.gb, st_a, {19, 16}, GdrKernel::Chunked);
        emu::options() = {true, seed};
        const GdrOut b = gdr_emu<float>(s, d.qkv, d.gb, st_b, {19, 16}, GdrKernel::Chunked);
        emu::options() = {};
        expect_identical("gdrc shuffled schedule == in order: output", a.o, b.o);
        expect_identical("gdrc shuffled schedule == in order: state", a.state, b.state);
    }
}

// ---------------------------------------------------------------- causal conv1d
template <class X, class W> struct ConvEntry;
#define CONV_TABLE(XN, X, WN, W)                                                               \
    template <> struct ConvEntry<X, W> {                                                       \
        static constexpr auto fn = conv::causal_conv1d_##XN##_##WN;                            \
    };
CONV_TABLE(f32, float, f32, float)
CONV_TABLE(f32, float, bf16, ushort)
CONV_TABLE(f32, float, f16, half)
CONV_TABLE(bf16, ushort, f32, float)
CONV_TABLE(bf16, ushort, bf16, ushort)
CONV_TABLE(bf16, ushort, f16, half)
CONV_TABLE(f16, half, f32, float)
CONV_TABLE(f16, half, bf16, ushort)
CONV_TABLE(f16, half, f16, half)

struct ConvOut {
    std::vector<double> x_seen, w_seen, y;
};

template <class X, class W>
static ConvOut conv_emu(uint b, uint t, uint c, uint k, const std::vector<float>& x_f,
                        const std::vector<float>& w_f) {
    const std::string tag = std::string("causal_conv1d_") + Dt<X>::name + "_" + Dt<W>::name;
    Buf<X> x(x_f.size());
    Buf<W> w(w_f.size());
    Buf<X> y(size_t(b) * t * c);
    ConvOut out;
    for (size_t i = 0; i < x_f.size(); ++i) {
        x[i] = Dt<X>::from(x_f[i]);
        out.x_seen.push_back(Dt<X>::to(x[i]));
    }
    for (size_t i = 0; i < w_f.size(); ++i) {
        w[i] = Dt<W>::from(w_f[i]);
        out.w_seen.push_back(Dt<W>::to(w[i]));
    }
    const conv::ConvParams p{b, t, c, k};
    const uint n = b * t * c;
    const uint3 groups = {(n + CONV_THREADS - 1) / CONV_THREADS, 1, 1};
    const uint3 tg = {CONV_THREADS, 1, 1};
    emu::dispatch_thread_groups(groups, tg, [&](const emu::Ids& id) {
        ConvEntry<X, W>::fn(x.data(), w.data(), y.data(), p, id.thread_position_in_grid.x);
    });
    x.check(tag + " x");
    w.check(tag + " w");
    y.check(tag + " y");
    for (size_t i = 0; i < y.n; ++i) out.y.push_back(Dt<X>::to(y[i]));
    return out;
}

static std::vector<double> conv_ref(uint b, uint t, uint c, uint k, const std::vector<double>& x,
                                    const std::vector<double>& w) {
    std::vector<double> y(size_t(b) * t * c);
    for (uint bi = 0; bi < b; ++bi)
        for (uint ti = 0; ti < t; ++ti)
            for (uint ci = 0; ci < c; ++ci) {
                double acc = 0;
                for (uint j = 0; j < k; ++j)
                    acc += w[size_t(ci) * k + j] * x[(size_t(bi) * (t + k - 1) + ti + j) * c + ci];
                y[(size_t(bi) * t + ti) * c + ci] = acc / (1.0 + std::exp(-acc));
            }
    return y;
}

template <class X, class W>
static ConvOut conv_case(uint b, uint t, uint c, uint k) {
    const auto x = patterned(size_t(b) * (k - 1 + t) * c, 0.4f, 2.0f);
    const auto w = patterned(size_t(c) * k, 1.7f, 0.5f);
    ConvOut got = conv_emu<X, W>(b, t, c, k, x, w);
    const auto ref = conv_ref(b, t, c, k, got.x_seen, got.w_seen);
    char name[128];
    std::snprintf(name, sizeof name, "conv x=%s w=%s B=%u T=%u C=%u K=%u", Dt<X>::name,
                  Dt<W>::name, b, t, c, k);
    compare(name, got.y, ref, 1e-5, Dt<X>::rel);
    return got;
}

static void conv_tests(uint64_t seed) {
    conv_case<float, float>(1, 1, 8, 4);
    conv_case<float, float>(2, 9, 24, 4);
    const ConvOut whole = conv_case<float, float>(3, 37, 40, 3);
    conv_case<ushort, ushort>(2, 9, 24, 4);
    conv_case<ushort, float>(2, 9, 24, 4);
    conv_case<half, half>(2, 9, 24, 4);
    conv_case<float, ushort>(1, 5, 16, 4);
    // Continuation: steps 18.. fed with the K−1 inputs before them == the whole run, exactly.
    {
        const uint b = 3, t = 37, c = 40, k = 3, cut = 18;
        const auto x = patterned(size_t(b) * (k - 1 + t) * c, 0.4f, 2.0f);
        const auto w = patterned(size_t(c) * k, 1.7f, 0.5f);
        std::vector<float> tail;
        for (uint bi = 0; bi < b; ++bi)
            tail.insert(tail.end(), x.begin() + (size_t(bi) * (k - 1 + t) + cut) * c,
                        x.begin() + (size_t(bi) + 1) * (k - 1 + t) * c);
        const ConvOut second = conv_emu<float, float>(b, t - cut, c, k, tail, w);
        std::vector<double> expect;
        for (uint bi = 0; bi < b; ++bi)
            expect.insert(expect.end(), whole.y.begin() + (size_t(bi) * t + cut) * c,
                          whole.y.begin() + (size_t(bi) + 1) * t * c);
        expect_identical("conv continuation (18 + 19 steps) == whole", second.y, expect);
        emu::options() = {true, seed};
        const ConvOut shuffled = conv_emu<float, float>(b, t, c, k, x, w);
        emu::options() = {};
        expect_identical("conv shuffled schedule == in order", shuffled.y, whole.y);
    }
}

// ---------------------------------------------------------------- fused elementwise ops
// Launch constants of src/{norm,attention}/metal.rs (ROWS_PER_GROUP simdgroups of 32 lanes, one
// row each) and src/{gates,swiglu,attention}/metal.rs (THREADS_PER_GROUP, one element each).
constexpr uint ROWS_PER_GROUP = 8;
constexpr uint THREADS_PER_GROUP = 256;

static_assert(sizeof(norm::RmsNormParams) == 24, "RmsNormParams layout");
static_assert(sizeof(norm::GatedNormParams) == 20, "GatedNormParams layout");
static_assert(sizeof(gates::GatesParams) == 12, "GatesParams layout");
static_assert(sizeof(swiglu::SwigluParams) == 8, "SwigluParams layout");
static_assert(sizeof(attn::QkNormRopeParams) == 36, "QkNormRopeParams layout");
static_assert(sizeof(attn::SoftmaxParams) == 20, "SoftmaxParams layout");
static_assert(sizeof(attn::GateParams) == 28, "GateParams layout");


// Entry points by element type, as the hosts pick them (`<stem>_<dtype suffix>`).
#define ENTRY_TABLE(NAME, NS, STEM)                                                            \
    template <class T> struct NAME;                                                            \
    template <> struct NAME<float> { static constexpr auto fn = NS::STEM##_f32; };             \
    template <> struct NAME<ushort> { static constexpr auto fn = NS::STEM##_bf16; };           \
    template <> struct NAME<half> { static constexpr auto fn = NS::STEM##_f16; };
ENTRY_TABLE(RmsNormEntry, norm, rms_norm)
ENTRY_TABLE(GatedNormEntry, norm, gated_rms_norm)
ENTRY_TABLE(GatesEntry, gates, deltanet_gates)
ENTRY_TABLE(SwigluEntry, swiglu, swiglu)
ENTRY_TABLE(RopeEntry, attn, qk_norm_rope)
ENTRY_TABLE(SoftmaxEntry, attn, causal_softmax)
ENTRY_TABLE(GateEntry, attn, attention_gate)
#undef ENTRY_TABLE

/// A guarded device buffer of T holding `v` rounded to T; `seen` gets the values as the kernel
/// reads them.
template <class T> static Buf<T> upload(const std::vector<float>& v, std::vector<double>* seen) {
    Buf<T> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
        b[i] = Dt<T>::from(v[i]);
        if (seen) seen->push_back(Dt<T>::to(b[i]));
    }
    return b;
}
template <class T> static std::vector<double> download(Buf<T>& b, const std::string& what) {
    b.check(what);
    std::vector<double> out;
    for (size_t i = 0; i < b.n; ++i) out.push_back(Dt<T>::to(b[i]));
    return out;
}
/// `x` rounded to T, as the kernels' round_to<T>.
template <class T> static double rnd(double x) { return Dt<T>::to(Dt<T>::from(float(x))); }

static void rows_dispatch(uint rows, const std::function<void(uint, uint)>& body) {
    emu::dispatch_thread_groups(uint3{(rows + ROWS_PER_GROUP - 1) / ROWS_PER_GROUP, 1, 1},
                                uint3{32 * ROWS_PER_GROUP, 1, 1}, [&](const emu::Ids& id) {
                                    body(id.threadgroup_position_in_grid.x, id.thread_index_in_threadgroup);
                                });
}
static void flat_dispatch(uint n, const std::function<void(uint)>& body) {
    emu::dispatch_thread_groups(uint3{(n + THREADS_PER_GROUP - 1) / THREADS_PER_GROUP, 1, 1},
                                uint3{THREADS_PER_GROUP, 1, 1},
                                [&](const emu::Ids& id) { body(id.thread_position_in_grid.x); });
}

/// A tolerance for results that pass through `roundings` roundings to T: where the exact value
/// sits at a rounding boundary, each may land one ulp (2·Dt::rel) away from the reference's.
template <class T> static double rounding_tol(int roundings) {
    return roundings == 1 ? Dt<T>::rel : 2.0 * Dt<T>::rel * roundings;
}
constexpr double F32_ABS = 1e-6, F32_REL = 1e-6;

// rms_norm: rows of x at `x_stride` (a slice of a wider tensor), optionally with a residual.
template <class T> static void rms_norm_case(uint rows, uint cols, uint x_stride, bool residual) {
    const std::string tag = std::string("rms_norm_") + Dt<T>::name;
    std::vector<double> xs, hs, ws;
    auto x = upload<T>(patterned(size_t(rows) * x_stride, 0.5f, 2.0f), &xs);
    const uint h_stride = cols;
    auto h = upload<T>(patterned(size_t(rows) * h_stride, 1.1f, 1.0f), &hs);
    auto w = upload<float>(patterned(cols, 2.3f, 0.5f), &ws);
    for (uint c = 0; c < cols; ++c) w[c] += 1.0f, ws[c] += 1.0;
    Buf<T> out(size_t(rows) * cols * (residual ? 2 : 1));
    const norm::RmsNormParams p{rows, cols, x_stride, h_stride, residual ? 1u : 0u, 1e-6f};
    rows_dispatch(rows, [&](uint tg, uint tid) {
        RmsNormEntry<T>::fn(x.data(), residual ? h.data() : x.data(), w.data(), out.data(), p,
                                    tg, tid / 32, tid % 32);
    });
    x.check(tag + " x");
    h.check(tag + " h");
    const auto got = download(out, tag + " out");
    std::vector<double> ref(out.n), sum_got, sum_ref;
    for (uint r = 0; r < rows; ++r) {
        std::vector<double> v(cols);
        double ss = 0;
        for (uint c = 0; c < cols; ++c) {
            v[c] = xs[size_t(r) * x_stride + c];
            if (residual) {
                v[c] = rnd<T>(float(v[c]) + float(hs[size_t(r) * h_stride + c])); // the dtype add
                ref[size_t(r) * cols + c] = v[c];
            }
            ss += v[c] * v[c];
        }
        const double inv = 1.0 / std::sqrt(ss / cols + 1e-6);
        for (uint c = 0; c < cols; ++c)
            ref[(residual ? size_t(rows) * cols : 0) + size_t(r) * cols + c] = v[c] * inv * ws[c];
    }
    char name[128];
    std::snprintf(name, sizeof name, "%s rows=%u cols=%u stride=%u%s", tag.c_str(), rows, cols,
                  x_stride, residual ? " +residual" : "");
    compare(name, got, ref, F32_ABS, F32_REL + rounding_tol<T>(1));
}

// gated_rms_norm: groups of dv, z rows of heads·dv at z_stride.
template <class T> static void gated_norm_case(uint rows, uint heads, uint dv, uint z_stride) {
    const std::string tag = std::string("gated_rms_norm_") + Dt<T>::name;
    const uint groups = rows * heads;
    std::vector<double> xs, zs, ws;
    auto x = upload<T>(patterned(size_t(groups) * dv, 0.3f, 2.0f), &xs);
    auto z = upload<T>(patterned(size_t(rows) * z_stride, 1.9f, 3.0f), &zs);
    auto w = upload<T>(patterned(dv, 2.7f, 1.0f), &ws);
    Buf<T> out(size_t(groups) * dv);
    const norm::GatedNormParams p{groups, heads, dv, z_stride, 1e-6f};
    rows_dispatch(groups, [&](uint tg, uint tid) {
        GatedNormEntry<T>::fn(x.data(), z.data(), w.data(), out.data(), p, tg, tid / 32,
                                      tid % 32);
    });
    x.check(tag + " x");
    z.check(tag + " z");
    const auto got = download(out, tag + " out");
    std::vector<double> ref(out.n);
    for (uint g = 0; g < groups; ++g) {
        double ss = 0;
        for (uint c = 0; c < dv; ++c) ss += xs[size_t(g) * dv + c] * xs[size_t(g) * dv + c];
        const double inv = 1.0 / std::sqrt(ss / dv + 1e-6);
        for (uint c = 0; c < dv; ++c) {
            const double zv = zs[size_t(g / heads) * z_stride + size_t(g % heads) * dv + c];
            const double n = rnd<T>(rnd<T>(xs[size_t(g) * dv + c] * inv) * ws[c]);
            ref[size_t(g) * dv + c] = n * zv / (1.0 + std::exp(-zv));
        }
    }
    char name[128];
    std::snprintf(name, sizeof name, "%s groups=%u (heads %u) dv=%u z_stride=%u", tag.c_str(),
                  groups, heads, dv, z_stride);
    compare(name, got, ref, F32_ABS, F32_REL + rounding_tol<T>(3));
}

template <class T> static void gates_case(uint rows, uint hv, uint stride) {
    const std::string tag = std::string("deltanet_gates_") + Dt<T>::name;
    std::vector<double> bas, dts, nas;
    // b and a spread over [−30, 30]: both sides of softplus' threshold, and exp(a) far below 1.
    auto ba = upload<T>(patterned(size_t(rows) * stride, 0.2f, 30.0f), &bas);
    auto dt = upload<float>(patterned(hv, 1.3f, 1.0f), &dts);
    auto na = upload<float>(patterned(hv, 2.1f, 1.0f), &nas);
    for (uint h = 0; h < hv; ++h) na[h] = -std::fabs(na[h]) - 0.1f, nas[h] = na[h];
    Buf<float> gb(size_t(rows) * hv * 2);
    const gates::GatesParams p{rows, hv, stride};
    flat_dispatch(rows * hv, [&](uint gid) {
        GatesEntry<T>::fn(ba.data(), dt.data(), na.data(), gb.data(), p, gid);
    });
    ba.check(tag + " ba");
    const auto got = download(gb, tag + " gb");
    std::vector<double> g_got, g_ref, b_got, b_ref;
    for (uint r = 0; r < rows; ++r)
        for (uint h = 0; h < hv; ++h) {
            const double b = bas[size_t(r) * stride + h];
            const double a = bas[size_t(r) * stride + hv + h] + dts[h];
            const double sp = a > 20 ? a : std::log1p(std::exp(a));
            const size_t i = size_t(r) * hv + h;
            g_got.push_back(got[2 * i]);
            g_ref.push_back(nas[h] * sp);
            b_got.push_back(got[2 * i + 1]);
            b_ref.push_back(rnd<T>(1.0 / (1.0 + std::exp(-b))));
        }
    char name[128];
    std::snprintf(name, sizeof name, "%s rows=%u hv=%u stride=%u: g", tag.c_str(), rows, hv, stride);
    compare(name, g_got, g_ref, F32_ABS, F32_REL);
    std::snprintf(name, sizeof name, "%s rows=%u hv=%u stride=%u: beta", tag.c_str(), rows, hv,
                  stride);
    compare(name, b_got, b_ref, F32_ABS, F32_REL + rounding_tol<T>(1));
}

template <class T> static void swiglu_case(uint rows, uint inter) {
    const std::string tag = std::string("swiglu_") + Dt<T>::name;
    std::vector<double> gus;
    auto gu = upload<T>(patterned(size_t(rows) * 2 * inter, 0.9f, 4.0f), &gus);
    Buf<T> out(size_t(rows) * inter);
    const swiglu::SwigluParams p{rows, inter};
    flat_dispatch(rows * inter, [&](uint gid) {
        SwigluEntry<T>::fn(gu.data(), out.data(), p, gid);
    });
    gu.check(tag + " gu");
    const auto got = download(out, tag + " out");
    std::vector<double> ref(out.n);
    for (uint r = 0; r < rows; ++r)
        for (uint c = 0; c < inter; ++c) {
            const double g = gus[size_t(r) * 2 * inter + c], u = gus[size_t(r) * 2 * inter + inter + c];
            ref[size_t(r) * inter + c] = rnd<T>(g / (1.0 + std::exp(-g))) * u;
        }
    char name[128];
    std::snprintf(name, sizeof name, "%s rows=%u inter=%u", tag.c_str(), rows, inter);
    compare(name, got, ref, F32_ABS, F32_REL + rounding_tol<T>(2));
}

// qk_norm_rope: x a slice of a wider [B, T, H, 2·hd] projection (sh = 2·hd), or contiguous.
template <class T> static void qk_norm_rope_case(uint b, uint t, uint heads, uint hd, uint rot,
                                                 bool sliced) {
    const std::string tag = std::string("qk_norm_rope_") + Dt<T>::name;
    const uint sh = sliced ? 2 * hd : hd, st = heads * sh, sb = t * st;
    std::vector<double> xs, ws, css;
    auto x = upload<T>(patterned(size_t(b) * sb, 0.6f, 2.0f), &xs);
    auto w = upload<float>(patterned(hd, 1.4f, 0.5f), &ws);
    for (uint c = 0; c < hd; ++c) w[c] += 1.0f, ws[c] += 1.0;
    auto cs = upload<T>(patterned(size_t(2) * b * t * rot, 2.2f, 1.0f), &css);
    Buf<T> out(size_t(b) * heads * t * hd);
    const attn::QkNormRopeParams p{b, t, heads, hd, rot, sb, st, sh, 1e-6f};
    rows_dispatch(b * heads * t, [&](uint tg, uint tid) {
        RopeEntry<T>::fn(x.data(), w.data(), cs.data(), out.data(), p, tg, tid / 32,
                                     tid % 32);
    });
    x.check(tag + " x");
    const auto got = download(out, tag + " out");
    std::vector<double> ref(out.n), n(hd);
    for (uint bi = 0; bi < b; ++bi)
        for (uint h = 0; h < heads; ++h)
            for (uint ti = 0; ti < t; ++ti) {
                const double* xr = &xs[size_t(bi) * sb + size_t(ti) * st + size_t(h) * sh];
                double ss = 0;
                for (uint c = 0; c < hd; ++c) ss += xr[c] * xr[c];
                const double inv = 1.0 / std::sqrt(ss / hd + 1e-6);
                for (uint c = 0; c < hd; ++c) n[c] = rnd<T>(xr[c] * inv * ws[c]);
                const size_t rs = (size_t(bi) * t + ti) * rot, sin_at = size_t(b) * t * rot;
                double* o = &ref[((size_t(bi) * heads + h) * t + ti) * hd];
                for (uint c = 0; c < hd; ++c) {
                    if (c < rot) {
                        const double rotated = c < rot / 2 ? -n[c + rot / 2] : n[c - rot / 2];
                        o[c] = rnd<T>(n[c] * css[rs + c]) + rnd<T>(rotated * css[sin_at + rs + c]);
                    } else {
                        o[c] = n[c];
                    }
                }
            }
    char name[128];
    std::snprintf(name, sizeof name, "%s B=%u T=%u H=%u hd=%u rot=%u%s", tag.c_str(), b, t, heads,
                  hd, rot, sliced ? " sliced" : "");
    compare(name, got, ref, F32_ABS, F32_REL + rounding_tol<T>(3));
}

// causal_softmax: T queries, the last T of S keys; row b's keys `pad[b]..` hidden by −∞ bias
// (a padded cache) as well as its first key when `hide_first`.
template <class T> static void softmax_case(uint b, uint groups, uint t, uint s,
                                            const std::vector<uint>& visible_from) {
    const std::string tag = std::string("causal_softmax_") + Dt<T>::name;
    std::vector<double> ss;
    auto sc = upload<T>(patterned(size_t(b) * groups * t * s, 0.8f, 6.0f), &ss);
    Buf<float> bias(size_t(b) * s);
    for (uint bi = 0; bi < b; ++bi)
        for (uint k = 0; k < s; ++k) bias[size_t(bi) * s + k] = k < visible_from[bi] ? -INFINITY : 0.0f;
    Buf<T> p(size_t(b) * groups * t * s);
    const float scale = 0.125f * 1.37f;
    const uint rows = b * groups * t;
    const attn::SoftmaxParams prm{rows, groups, t, s, scale};
    rows_dispatch(rows, [&](uint tg, uint tid) {
        SoftmaxEntry<T>::fn(sc.data(), bias.data(), p.data(), prm, tg, tid / 32, tid % 32);
    });
    sc.check(tag + " s");
    bias.check(tag + " bias");
    const auto got = download(p, tag + " p");
    std::vector<double> ref(p.n, 0.0);
    for (uint r = 0; r < rows; ++r) {
        const uint ti = r % t, bi = r / (groups * t), seen = s - t + ti + 1;
        double mx = -INFINITY, sum = 0;
        std::vector<double> v(seen);
        for (uint k = 0; k < seen; ++k) {
            v[k] = rnd<T>(ss[size_t(r) * s + k] * scale) + bias[size_t(bi) * s + k];
            mx = std::max(mx, v[k]);
        }
        for (uint k = 0; k < seen; ++k) sum += std::exp(v[k] - mx);
        for (uint k = 0; k < seen; ++k) ref[size_t(r) * s + k] = std::exp(v[k] - mx) / sum;
    }
    bool later_zero = true;
    for (uint r = 0; r < rows; ++r)
        for (uint k = s - t + r % t + 1; k < s; ++k) later_zero &= got[size_t(r) * s + k] == 0.0;
    char name[128];
    std::snprintf(name, sizeof name, "%s B=%u G=%u T=%u S=%u", tag.c_str(), b, groups, t, s);
    compare(name, got, ref, F32_ABS, F32_REL + rounding_tol<T>(2));
    std::printf("%-58s %s\n", (std::string(name) + ": later keys exactly 0").c_str(),
                later_zero ? "ok" : "FAIL");
    g_failures += !later_zero;
}

// attention_gate: gate a slice of a wider [B, T, H, 2·hd] projection (sh = 2·hd); `out_at`
// elements of `out` before this part (the join writes a packed batch's two parts in place).
template <class T> static std::vector<double> gate_launch(uint b, uint t, uint heads, uint hd,
                                                          const std::vector<float>& o_f,
                                                          const std::vector<float>& g_f, uint sb,
                                                          uint st, uint sh, std::vector<double>& ref) {
    const std::string tag = std::string("attention_gate_") + Dt<T>::name;
    std::vector<double> os, gs;
    auto o = upload<T>(o_f, &os);
    auto g = upload<T>(g_f, &gs);
    Buf<T> out(size_t(b) * t * heads * hd);
    const attn::GateParams p{b, t, heads, hd, sb, st, sh};
    flat_dispatch(b * t * heads * hd, [&](uint gid) {
        GateEntry<T>::fn(o.data(), g.data(), out.data(), p, gid);
    });
    o.check(tag + " o");
    g.check(tag + " gate");
    ref.assign(out.n, 0.0);
    for (uint bi = 0; bi < b; ++bi)
        for (uint ti = 0; ti < t; ++ti)
            for (uint h = 0; h < heads; ++h)
                for (uint c = 0; c < hd; ++c) {
                    const double gv = gs[size_t(bi) * sb + size_t(ti) * st + size_t(h) * sh + c];
                    const double ov = os[((size_t(bi) * heads + h) * t + ti) * hd + c];
                    ref[((size_t(bi) * t + ti) * heads + h) * hd + c] =
                        ov * rnd<T>(1.0 / (1.0 + std::exp(-gv)));
                }
    return download(out, tag + " out");
}
template <class T> static void gate_case(uint b, uint t, uint heads, uint hd, bool sliced) {
    const uint sh = sliced ? 2 * hd : hd, st = heads * sh, sb = t * st;
    std::vector<double> ref;
    const auto got = gate_launch<T>(b, t, heads, hd, patterned(size_t(b) * heads * t * hd, 0.4f, 2.0f),
                                    patterned(size_t(b) * sb, 1.6f, 4.0f), sb, st, sh, ref);
    char name[128];
    std::snprintf(name, sizeof name, "attention_gate_%s B=%u T=%u H=%u hd=%u%s", Dt<T>::name, b, t,
                  heads, hd, sliced ? " sliced" : "");
    compare(name, got, ref, F32_ABS, F32_REL + rounding_tol<T>(2));
}

static void fused_op_tests(uint64_t seed) {
    // Norms: rows not a multiple of the 8 per threadgroup, cols not a multiple of 32, rows that
    // are a slice of a wider tensor, the residual form; every dtype.
    rms_norm_case<float>(5, 40, 40, false);
    rms_norm_case<float>(11, 72, 96, false);
    rms_norm_case<float>(9, 1024, 1024, true);
    rms_norm_case<ushort>(11, 72, 96, true);
    rms_norm_case<half>(3, 33, 50, true);
    rms_norm_case<ushort>(7, 1, 1, false);
    gated_norm_case<float>(3, 2, 16, 32);
    gated_norm_case<float>(5, 3, 128, 3 * 128 + 40);
    gated_norm_case<ushort>(5, 3, 128, 3 * 128 + 40);
    gated_norm_case<half>(4, 2, 20, 41);
    gates_case<float>(9, 3, 6);
    gates_case<float>(37, 16, 32 + 5);
    gates_case<ushort>(9, 3, 10);
    gates_case<half>(4, 5, 10);
    swiglu_case<float>(3, 37);
    swiglu_case<float>(5, 300);
    swiglu_case<ushort>(5, 300);
    swiglu_case<half>(2, 33);
    qk_norm_rope_case<float>(2, 5, 3, 64, 16, true);
    qk_norm_rope_case<float>(1, 7, 2, 40, 40, false);
    qk_norm_rope_case<float>(1, 3, 1, 256, 64, false);
    qk_norm_rope_case<ushort>(2, 5, 3, 64, 16, true);
    qk_norm_rope_case<half>(2, 3, 2, 48, 24, true);
    // Softmax: T = S, a prefix of past keys (T < S), padded keys at a row's start, S past 32.
    softmax_case<float>(1, 2, 5, 5, {0});
    softmax_case<float>(2, 3, 4, 37, {0, 6});
    softmax_case<float>(2, 1, 1, 70, {3, 0});
    softmax_case<ushort>(2, 3, 4, 37, {0, 6});
    softmax_case<half>(2, 2, 3, 19, {2, 0});
    gate_case<float>(2, 5, 3, 16, true);
    gate_case<float>(1, 37, 2, 24, false);
    gate_case<ushort>(2, 5, 3, 16, true);
    gate_case<half>(1, 3, 4, 8, false);
    // The split layout of attention_gate_join: states [R, H, S, hd] and branches [B, H, T, hd]
    // with their gates packed as [R·S + B·T, H, hd] rows (sb = S·H·hd, st = H·hd, sh = hd for
    // the first part; the second part starts R·S rows in). Each part's launch against the double
    // loop; the host writes them to one buffer at offsets 0 and R·S·H·hd.
    {
        const uint r = 2, s = 5, b = 3, t = 2, heads = 2, hd = 8;
        const auto gate = patterned(size_t(r * s + b * t) * heads * hd, 0.7f, 3.0f);
        const std::vector<float> g_states(gate.begin(), gate.begin() + size_t(r) * s * heads * hd);
        const std::vector<float> g_branches(gate.begin() + size_t(r) * s * heads * hd, gate.end());
        std::vector<double> ref;
        auto got = gate_launch<float>(r, s, heads, hd, patterned(size_t(r) * heads * s * hd, 0.1f, 2.0f),
                                      g_states, s * heads * hd, heads * hd, hd, ref);
        compare("attention_gate_f32 join: states R=2 S=5", got, ref, F32_ABS, F32_REL);
        got = gate_launch<float>(b, t, heads, hd, patterned(size_t(b) * heads * t * hd, 0.2f, 2.0f),
                                 g_branches, t * heads * hd, heads * hd, hd, ref);
        compare("attention_gate_f32 join: branches B=3 T=2", got, ref, F32_ABS, F32_REL);
    }
    // Shuffled schedule (threadgroup and fiber order): the same comparisons still pass.
    {
        emu::options() = {true, seed};
        rms_norm_case<float>(11, 72, 96, true);
        softmax_case<float>(2, 3, 4, 37, {0, 6});
        emu::options() = {};
    }
}

// ---------------------------------------------------------------- flash attention
static_assert(sizeof(flash::FlashParams) == 80, "FlashParams layout");
template <class T> struct FlashEntry;
template <> struct FlashEntry<float> { static constexpr auto fn = flash::flash_attention_f32; };
template <> struct FlashEntry<ushort> { static constexpr auto fn = flash::flash_attention_bf16; };
template <> struct FlashEntry<half> { static constexpr auto fn = flash::flash_attention_f16; };

struct FlashShape {
    uint b, hq, hkv, t, l, s, rows_past, hd;
};

/// This step's k and v are views of a per-step projection [B, L, 2·Hkv, hd] (k heads, then v
/// heads: strides b = L·2·Hkv·hd, h = hd, l = 2·Hkv·hd), the past [R, Hkv, S, hd] contiguous.
/// `hidden[b]`: the keys (of S + L) of row b that the bias hides.
template <class T> static void flash_case(const FlashShape& s, const std::vector<uint>& owners_in,
                                          const std::vector<std::vector<uint>>& hidden, float salt) {
    const std::string tag = std::string("flash_attention_") + Dt<T>::name;
    std::vector<double> qs, projs, kps, vps;
    auto q = upload<T>(patterned(size_t(s.b) * s.hq * s.t * s.hd, salt, 1.5f), &qs);
    const uint kv_l = 2 * s.hkv * s.hd, kv_b = s.l * kv_l;
    auto proj = upload<T>(patterned(size_t(s.b) * kv_b, salt + 0.5f, 1.5f), &projs);
    const size_t past_n = std::max<size_t>(size_t(s.rows_past) * s.hkv * s.s * s.hd, 1);
    auto kp = upload<T>(patterned(past_n, salt + 1.0f, 1.5f), &kps);
    auto vp = upload<T>(patterned(past_n, salt + 1.5f, 1.5f), &vps);
    Buf<uint> owners(std::max<size_t>(s.b, 1));
    for (uint b = 0; b < s.b; ++b) owners[b] = s.s > 0 ? owners_in[b] : 0;
    Buf<float> bias(size_t(s.b) * (s.s + s.l));
    for (uint b = 0; b < s.b; ++b)
        for (uint j = 0; j < s.s + s.l; ++j) {
            const bool hide = std::find(hidden[b].begin(), hidden[b].end(), j) != hidden[b].end();
            bias[size_t(b) * (s.s + s.l) + j] = hide ? -INFINITY : 0.05f * float(j % 7);
        }
    Buf<T> out(size_t(s.b) * s.hq * s.t * s.hd);
    const float scale = 1.0f / std::sqrt(float(s.hd));
    const uint past_h = s.s * s.hd, past_b = s.hkv * past_h;
    const flash::FlashParams p{s.b, s.hq, s.hkv, s.t, s.l, s.s, s.hd,
                               kv_b, s.hd, kv_l, kv_b, s.hd, kv_l,
                               past_b, past_h, s.hd, past_b, past_h, s.hd, scale};
    const uint rows = s.b * s.hq * s.t;
    rows_dispatch(rows, [&](uint tg, uint tid) {
        FlashEntry<T>::fn(q.data(), proj.data(), proj.data() + s.hkv * s.hd, kp.data(), vp.data(),
                          owners.data(), bias.data(), out.data(), p, tg, tid / 32, tid % 32);
    });
    q.check(tag + " q");
    proj.check(tag + " k/v");
    kp.check(tag + " k_past");
    vp.check(tag + " v_past");
    const auto got = download(out, tag + " out");
    std::vector<double> ref(out.n, 0.0);
    double score_terms = 1.0; // the largest Σ|q_c·k_c|·scale: what bounds a score's f32 error
    for (uint r = 0; r < rows; ++r) {
        const uint t = r % s.t, hq = (r / s.t) % s.hq, b = r / (s.t * s.hq);
        const uint h = hq / (s.hq / s.hkv);
        std::vector<double> sc;
        std::vector<const double*> vals;
        auto key = [&](const double* kr, const double* vr, double bv) {
            double d = 0, terms = 0;
            for (uint c = 0; c < s.hd; ++c) {
                d += qs[size_t(r) * s.hd + c] * kr[c];
                terms += std::fabs(qs[size_t(r) * s.hd + c] * kr[c]);
            }
            score_terms = std::max(score_terms, terms * scale);
            sc.push_back(d * scale + bv);
            vals.push_back(vr);
        };
        const float* br = &bias[size_t(b) * (s.s + s.l)];
        for (uint j = 0; j < s.s; ++j) {
            const size_t at = size_t(owners[b]) * past_b + size_t(h) * past_h + size_t(j) * s.hd;
            key(&kps[at], &vps[at], br[j]);
        }
        for (uint j = 0; j < s.l - s.t + t + 1; ++j) {
            const size_t at = size_t(b) * kv_b + size_t(j) * kv_l + size_t(h) * s.hd;
            key(&projs[at], &projs[at + size_t(s.hkv) * s.hd], br[s.s + j]);
        }
        double mx = -INFINITY, sum = 0;
        for (double v : sc) mx = std::max(mx, v);
        if (mx == -INFINITY) continue; // no visible key: zeros
        for (double v : sc) sum += std::exp(v - mx);
        for (size_t j = 0; j < sc.size(); ++j) {
            const double w = std::exp(sc[j] - mx) / sum;
            for (uint c = 0; c < s.hd; ++c) ref[size_t(r) * s.hd + c] += w * vals[j][c];
        }
    }
    char name[128];
    std::snprintf(name, sizeof name, "%s B=%u Hq=%u Hkv=%u T=%u L=%u S=%u hd=%u", tag.c_str(), s.b,
                  s.hq, s.hkv, s.t, s.l, s.s, s.hd);
    // Every step in f32 against double, the scores' error relative to their terms' magnitude
    // (values are unit-scale); the output rounded to T once.
    compare(name, got, ref, F32_ABS * score_terms, F32_REL + Dt<T>::rel);
}

static void flash_tests(uint64_t seed) {
    // No past, T = L, GQA 2:1, hd no multiple of 32.
    flash_case<float>({2, 4, 2, 5, 5, 0, 0, 40}, {}, {{}, {}}, 0.3f);
    // This step's queries the last 3 of 7 keys; padded keys at row 1's start.
    flash_case<float>({2, 2, 1, 3, 7, 0, 0, 32}, {}, {{}, {0, 1}}, 0.9f);
    // Branches over a past: 3 rows reading past rows [1, 0, 1] of 2, padded past keys, hd 256.
    flash_case<float>({3, 4, 2, 2, 2, 6, 2, 256}, {1, 0, 1}, {{0}, {}, {0, 1, 2}}, 1.7f);
    flash_case<float>({3, 2, 2, 4, 4, 37, 2, 24}, {1, 0, 1}, {{}, {5}, {}}, 2.1f);
    // A row whose every key is hidden: zeros.
    flash_case<float>({2, 1, 1, 1, 1, 3, 1, 16}, {0, 0}, {{0, 1, 2, 3}, {}}, 2.5f);
    flash_case<ushort>({3, 4, 2, 2, 3, 6, 2, 64}, {1, 0, 1}, {{0}, {}, {0, 1}}, 1.1f);
    flash_case<half>({2, 2, 1, 3, 5, 4, 1, 48}, {0, 0}, {{}, {1}}, 1.3f);
    emu::options() = {true, seed};
    flash_case<float>({3, 4, 2, 2, 2, 6, 2, 40}, {1, 0, 1}, {{0}, {}, {0, 1, 2}}, 1.9f);
    emu::options() = {};
}

// ---------------------------------------------------------------- row gathers
static_assert(sizeof(gather::GatherRowsParams) == 12, "GatherRowsParams layout");
static_assert(sizeof(gather::GatherCatParams) == 20, "GatherCatParams layout");

/// Exact copies: every unit of the output against the element it must hold, bit for bit.
template <class U> static void gather_case(uint src_rows, uint heads, uint s_units, uint t_units,
                                           const std::vector<uint>& idx_in) {
    const char* unit = sizeof(U) == 2 ? "u16" : "u32";
    const uint n = uint(idx_in.size()), row = heads * s_units;
    Buf<U> src(size_t(src_rows) * row), tail(std::max<size_t>(size_t(n) * heads * t_units, 1));
    for (size_t i = 0; i < src.n; ++i) src[i] = U(i * 7 + 1);
    for (size_t i = 0; i < tail.n; ++i) tail[i] = U(i * 5 + 3);
    Buf<uint> idx(n);
    bool past_end = false;
    for (uint r = 0; r < n; ++r) idx[r] = idx_in[r], past_end |= idx_in[r] >= src_rows;
    // gather_rows: whole rows of heads·s_units.
    {
        Buf<U> out(size_t(n) * row);
        const gather::GatherRowsParams p{n, row, src_rows};
        flat_dispatch(n * row, [&](uint gid) {
            if constexpr (sizeof(U) == 2) {
                gather::gather_rows_u16(src.data(), idx.data(), out.data(), p, gid);
            } else {
                gather::gather_rows_u32(src.data(), idx.data(), out.data(), p, gid);
            }
        });
        out.check("gather_rows out");
        bool ok = true;
        for (uint r = 0; r < n; ++r)
            for (uint i = 0; i < row; ++i) {
                const U want = idx[r] < src_rows ? src[size_t(idx[r]) * row + i] : U(0);
                ok &= out[size_t(r) * row + i] == want;
            }
        char name[128];
        std::snprintf(name, sizeof name, "gather_rows_%s n=%u row=%u%s", unit, n, row,
                      past_end ? " (an index past the end: 0)" : "");
        std::printf("%-58s %s\n", name, ok ? "exact ok" : "FAIL");
        g_failures += !ok;
    }
    // gather_cat: per (row, head), the picked src part then the row's own tail.
    {
        const uint width = s_units + t_units;
        Buf<U> out(size_t(n) * heads * width);
        const gather::GatherCatParams p{n, heads, s_units, t_units, src_rows};
        flat_dispatch(n * heads * width, [&](uint gid) {
            if constexpr (sizeof(U) == 2) {
                gather::gather_cat_u16(src.data(), idx.data(), tail.data(), out.data(), p, gid);
            } else {
                gather::gather_cat_u32(src.data(), idx.data(), tail.data(), out.data(), p, gid);
            }
        });
        out.check("gather_cat out");
        bool ok = true;
        for (uint b = 0; b < n; ++b)
            for (uint h = 0; h < heads; ++h)
                for (uint i = 0; i < width; ++i) {
                    const U want = i >= s_units ? tail[(size_t(b) * heads + h) * t_units + i - s_units]
                                   : idx[b] < src_rows ? src[(size_t(idx[b]) * heads + h) * s_units + i]
                                                       : U(0);
                    ok &= out[(size_t(b) * heads + h) * width + i] == want;
                }
        char name[128];
        std::snprintf(name, sizeof name, "gather_cat_%s n=%u heads=%u S=%u T=%u units", unit, n, heads,
                      s_units, t_units);
        std::printf("%-58s %s\n", name, ok ? "exact ok" : "FAIL");
        g_failures += !ok;
    }
}

static void gather_tests() {
    gather_case<ushort>(3, 2, 37, 5, {2, 0, 2, 7});
    gather_case<uint>(2, 3, 64, 1, {1, 1, 0});
    gather_case<uint>(4, 1, 300, 0, {3});
}

// ---------------------------------------------------------------- causal conv1d, cached
static_assert(sizeof(conv::ConvCachedParams) == 20, "ConvCachedParams layout");
#define CONV_CACHED_TABLE(XN, X, WN, W)                                                        \
    template <> struct ConvCachedEntry<X, W> {                                                 \
        static constexpr auto fn = conv::causal_conv1d_cached_##XN##_##WN;                     \
    };
template <class X, class W> struct ConvCachedEntry;
CONV_CACHED_TABLE(f32, float, f32, float)
CONV_CACHED_TABLE(bf16, ushort, f32, float)
CONV_CACHED_TABLE(bf16, ushort, bf16, ushort)
CONV_CACHED_TABLE(f16, half, f16, half)

/// x rows of a wider [B·T, x_stride] projection, lengths per row: y against the double loop over
/// the window [cache; x], the next cache (window rows len .. len + K − 2) bit for bit.
template <class X, class W> static void conv_cached_case(uint b, uint t, uint c, uint k, uint x_stride,
                                                         const std::vector<uint>& len) {
    const std::string tag = std::string("causal_conv1d_cached_") + Dt<X>::name + "_" + Dt<W>::name;
    std::vector<double> xs, cs, ws;
    auto x = upload<X>(patterned(size_t(b) * t * x_stride, 0.3f, 2.0f), &xs);
    auto cache = upload<X>(patterned(size_t(b) * (k - 1) * c, 1.2f, 2.0f), &cs);
    auto w = upload<W>(patterned(size_t(c) * k, 2.4f, 0.5f), &ws);
    Buf<uint> lengths(b);
    for (uint i = 0; i < b; ++i) lengths[i] = len[i];
    const size_t ny = size_t(b) * t * c, nn = size_t(b) * (k - 1) * c;
    Buf<X> out(ny + nn);
    const conv::ConvCachedParams p{b, t, c, k, x_stride};
    flat_dispatch(uint(ny + nn), [&](uint gid) {
        ConvCachedEntry<X, W>::fn(x.data(), cache.data(), w.data(), lengths.data(), out.data(), p, gid);
    });
    x.check(tag + " x");
    cache.check(tag + " cache");
    const auto got = download(out, tag + " out");
    auto window = [&](uint bi, uint row, uint ci) {
        return row < k - 1 ? cs[(size_t(bi) * (k - 1) + row) * c + ci]
                           : xs[(size_t(bi) * t + row - (k - 1)) * x_stride + ci];
    };
    std::vector<double> y_ref(ny), y_got(got.begin(), got.begin() + ny);
    for (uint bi = 0; bi < b; ++bi)
        for (uint ti = 0; ti < t; ++ti)
            for (uint ci = 0; ci < c; ++ci) {
                double acc = 0;
                for (uint j = 0; j < k; ++j) acc += ws[size_t(ci) * k + j] * window(bi, ti + j, ci);
                y_ref[(size_t(bi) * t + ti) * c + ci] = acc / (1.0 + std::exp(-acc));
            }
    std::vector<double> next_ref(nn), next_got(got.begin() + ny, got.end());
    for (uint bi = 0; bi < b; ++bi)
        for (uint r = 0; r + 1 < k; ++r)
            for (uint ci = 0; ci < c; ++ci)
                next_ref[(size_t(bi) * (k - 1) + r) * c + ci] = window(bi, len[bi] + r, ci);
    char name[128];
    std::snprintf(name, sizeof name, "%s B=%u T=%u C=%u K=%u stride=%u", tag.c_str(), b, t, c, k,
                  x_stride);
    compare(std::string(name) + " y", y_got, y_ref, 1e-5, Dt<X>::rel);
    expect_identical(std::string(name) + " next cache", next_got, next_ref);
}

static void conv_cached_tests() {
    conv_cached_case<float, float>(2, 9, 24, 4, 40, {9, 6});
    conv_cached_case<float, float>(3, 1, 16, 4, 16, {1, 0, 1});
    conv_cached_case<float, float>(1, 37, 40, 3, 50, {37});
    conv_cached_case<ushort, float>(2, 9, 24, 4, 30, {9, 2});
    conv_cached_case<ushort, ushort>(2, 5, 24, 4, 24, {5, 5});
    conv_cached_case<half, half>(2, 5, 20, 4, 33, {3, 5});
}


// ---------------------------------------------------------------- the split forms
// The records' state rows and the branch rows continuing them, as src/causal_conv1d/metal.rs and
// src/gated_delta_rule/metal.rs launch them, against the composition they replace run through
// the per-part kernels above (states from zeros, the states' next caches or final states copied
// to their branch rows, the branches from those): the same products in the same order, so the
// same bits; and the tolerances of the brief besides (f32 1e-6, 16-bit one rounding).
struct SplitShape {
    std::vector<uint> state_len; // R rows of S steps
    uint s;
    std::vector<uint> branch_len; // B rows of T steps
    uint t;
    std::vector<uint> owners;
    uint r() const { return uint(state_len.size()); }
    uint b() const { return uint(branch_len.size()); }
};

static std::string split_name(const std::string& tag, const SplitShape& sp) {
    std::string n = tag + " R=" + std::to_string(sp.r()) + " S=" + std::to_string(sp.s) +
                    " B=" + std::to_string(sp.b()) + " T=" + std::to_string(sp.t) + " owners=";
    for (uint o : sp.owners) n += std::to_string(o);
    return n;
}

static_assert(sizeof(conv::ConvSplitParams) == 32, "ConvSplitParams layout");
template <class X, class W> struct ConvSplitEntry;
#define CONV_SPLIT_TABLE(XN, X, WN, W)                                                         \
    template <> struct ConvSplitEntry<X, W> {                                                  \
        static constexpr auto fn = conv::causal_conv1d_split_##XN##_##WN;                      \
    };
CONV_SPLIT_TABLE(f32, float, f32, float)
CONV_SPLIT_TABLE(bf16, ushort, bf16, ushort)
CONV_SPLIT_TABLE(f16, half, f16, half)

/// The split conv: state rows xs (stride ss) and branch rows xb (stride bs) of C channels, K taps.
template <class X> static void conv_split_case(const SplitShape& sp, uint c, uint k, uint ss, uint bs) {
    const std::string tag = std::string("causal_conv1d_split_") + Dt<X>::name;
    const uint R = sp.r(), S = sp.s, B = sp.b(), T = sp.t;
    const auto xs_f = patterned(size_t(R) * S * ss, 0.3f, 2.0f);
    const auto xb_f = patterned(size_t(B) * T * bs, 1.1f, 2.0f);
    const auto w_f = patterned(size_t(c) * k, 2.4f, 0.5f);
    auto xs = upload<X>(xs_f, nullptr);
    auto xb = upload<X>(xb_f, nullptr);
    auto w = upload<X>(w_f, nullptr);
    Buf<uint> state_len(R), owners(B);
    for (uint i = 0; i < R; ++i) state_len[i] = sp.state_len[i];
    for (uint i = 0; i < B; ++i) owners[i] = sp.owners[i];
    const size_t n_s = size_t(R) * S * c, n = n_s + size_t(B) * T * c;
    Buf<X> out(n);
    const conv::ConvSplitParams p{R, S, B, T, c, k, ss, bs};
    flat_dispatch(uint(n), [&](uint gid) {
        ConvSplitEntry<X, X>::fn(xs.data(), xb.data(), w.data(), state_len.data(), owners.data(),
                                 out.data(), p, gid);
    });
    xs.check(tag + " xs");
    xb.check(tag + " xb");
    state_len.check(tag + " state lengths");
    owners.check(tag + " owners");
    const auto got = download(out, tag + " out");

    // The composition: the cached kernel on the states from a zero cache, each state row's next
    // cache copied to its branch rows, the cached kernel on the branches from those.
    std::vector<double> composed;
    Buf<X> zeros(size_t(R) * (k - 1) * c);
    for (size_t i = 0; i < zeros.n; ++i) zeros[i] = Dt<X>::from(0.0f);
    const size_t ny_s = n_s, nn_s = size_t(R) * (k - 1) * c;
    Buf<X> out_s(ny_s + nn_s);
    const conv::ConvCachedParams ps{R, S, c, k, ss};
    flat_dispatch(uint(ny_s + nn_s), [&](uint gid) {
        ConvCachedEntry<X, X>::fn(xs.data(), zeros.data(), w.data(), state_len.data(), out_s.data(),
                                  ps, gid);
    });
    const auto got_s = download(out_s, tag + " composed states");
    composed.insert(composed.end(), got_s.begin(), got_s.begin() + ny_s);
    Buf<X> cache_b(size_t(B) * (k - 1) * c);
    for (uint b = 0; b < B; ++b)
        for (size_t i = 0; i < size_t(k - 1) * c; ++i)
            cache_b[size_t(b) * (k - 1) * c + i] = out_s[ny_s + size_t(sp.owners[b]) * (k - 1) * c + i];
    Buf<uint> branch_len(B);
    for (uint i = 0; i < B; ++i) branch_len[i] = sp.branch_len[i];
    const size_t ny_b = size_t(B) * T * c, nn_b = size_t(B) * (k - 1) * c;
    Buf<X> out_b(ny_b + nn_b);
    const conv::ConvCachedParams pb{B, T, c, k, bs};
    flat_dispatch(uint(ny_b + nn_b), [&](uint gid) {
        ConvCachedEntry<X, X>::fn(xb.data(), cache_b.data(), w.data(), branch_len.data(), out_b.data(),
                                  pb, gid);
    });
    const auto got_b = download(out_b, tag + " composed branches");
    composed.insert(composed.end(), got_b.begin(), got_b.begin() + ny_b);

    const std::string name = split_name(tag, sp) + " C=" + std::to_string(c) + " K=" + std::to_string(k);
    compare(name + " vs composed", got, composed, F32_ABS, Dt<X>::rel);
    expect_identical(name + " vs composed", got, composed);
}

static void conv_split_tests() {
    // Padded states (one shorter than the window, one empty), branches out of order.
    conv_split_case<float>({{9, 2, 0}, 9, {5, 3, 5, 1}, 5, {1, 0, 2, 1}}, 24, 4, 40, 30);
    conv_split_case<float>({{37}, 37, {1, 1}, 1, {0, 0}}, 16, 4, 16, 20);
    conv_split_case<float>({{6, 11}, 11, {7, 7, 7}, 7, {1, 1, 0}}, 33, 3, 50, 33);
    conv_split_case<ushort>({{9, 2}, 9, {5, 3, 5}, 5, {1, 0, 1}}, 24, 4, 28, 24);
    conv_split_case<half>({{13, 5, 8}, 13, {4, 4, 2, 4}, 4, {2, 0, 1, 2}}, 20, 4, 33, 21);
}

template <class T> struct GdrSplitEntries;
#define GDR_SPLIT_TABLE(TN, T)                                                                 \
    template <> struct GdrSplitEntries<T> {                                                    \
        using Rec = decltype(&gdr::gated_delta_rule_states_##TN##_nk1);                        \
        using Chunk = decltype(&gdr::gated_delta_rule_chunked_states_##TN##_dk32);             \
        static Rec rec(uint nk) {                                                              \
            switch (nk) {                                                                      \
            case 1: return gdr::gated_delta_rule_states_##TN##_nk1;                            \
            case 2: return gdr::gated_delta_rule_states_##TN##_nk2;                            \
            case 4: return gdr::gated_delta_rule_states_##TN##_nk4;                            \
            case 8: return gdr::gated_delta_rule_states_##TN##_nk8;                            \
            }                                                                                  \
            emu::fail("no split gated_delta_rule variant for NK " + std::to_string(nk));       \
        }                                                                                      \
        using RecB = decltype(&gdr::gated_delta_rule_branches_##TN##_nk1);                     \
        static RecB rec_branches(uint nk) {                                                    \
            switch (nk) {                                                                      \
            case 1: return gdr::gated_delta_rule_branches_##TN##_nk1;                          \
            case 2: return gdr::gated_delta_rule_branches_##TN##_nk2;                          \
            case 4: return gdr::gated_delta_rule_branches_##TN##_nk4;                          \
            case 8: return gdr::gated_delta_rule_branches_##TN##_nk8;                          \
            }                                                                                  \
            emu::fail("no split gated_delta_rule variant for NK " + std::to_string(nk));       \
        }                                                                                      \
        static Chunk chunk(uint dkp) {                                                         \
            switch (dkp) {                                                                     \
            case 32: return gdr::gated_delta_rule_chunked_states_##TN##_dk32;                  \
            case 64: return gdr::gated_delta_rule_chunked_states_##TN##_dk64;                  \
            case 128: return gdr::gated_delta_rule_chunked_states_##TN##_dk128;                \
            }                                                                                  \
            emu::fail("no split chunked variant for Dk " + std::to_string(dkp));               \
        }                                                                                      \
        using ChunkB = decltype(&gdr::gated_delta_rule_chunked_branches_##TN##_dk32);          \
        static ChunkB chunk_branches(uint dkp) {                                               \
            switch (dkp) {                                                                     \
            case 32: return gdr::gated_delta_rule_chunked_branches_##TN##_dk32;                \
            case 64: return gdr::gated_delta_rule_chunked_branches_##TN##_dk64;                \
            case 128: return gdr::gated_delta_rule_chunked_branches_##TN##_dk128;              \
            }                                                                                  \
            emu::fail("no split chunked variant for Dk " + std::to_string(dkp));               \
        }                                                                                      \
    };
GDR_SPLIT_TABLE(f32, float)
GDR_SPLIT_TABLE(bf16, ushort)
GDR_SPLIT_TABLE(f16, half)

/// One part's dispatch of the split delta rule as metal.rs encodes it: the states' (from zero
/// states, `owners` null) or the branches' (from state rows `owners[b]`), Auto's kernel choice
/// for the part's width. Returns whether it ran chunked.
template <class T>
static bool gdr_split_part(const GdrShape& s, T* qkv, float* gb, float* state, T* o, uint* lengths,
                           uint* owners) {
    const bool chunked = gdr_auto_chunked<T>(s) && s.t > 0;
    const gdr::GdrParams p{s.b, s.t, s.hk, s.hv, s.dk, s.dv, 1.0f / std::sqrt(float(s.dk)), 1e-6f};
    using E = GdrSplitEntries<T>;
    if (chunked) {
        const uint dkp = gdrc_dk_variant(s.dk), simdgroups = GDRC_COLS / 8;
        const uint3 groups = {(s.dv + GDRC_COLS - 1) / GDRC_COLS, s.hv, s.b};
        const uint3 tg = {SIMD_W * simdgroups, 1, 1};
        emu::dispatch_thread_groups(
            groups, tg,
            [&](const emu::Ids& id) {
                float* shared = reinterpret_cast<float*>(id.threadgroup_memory);
                if (owners) {
                    E::chunk_branches(dkp)(qkv, gb, state, o, lengths, p, owners, shared,
                                           id.threadgroup_position_in_grid,
                                           id.simdgroup_index_in_threadgroup,
                                           id.simdgroups_per_threadgroup, id.thread_index_in_simdgroup);
                } else {
                    E::chunk(dkp)(qkv, gb, state, o, lengths, p, shared, id.threadgroup_position_in_grid,
                                  id.simdgroup_index_in_threadgroup, id.simdgroups_per_threadgroup,
                                  id.thread_index_in_simdgroup);
                }
            },
            gdrc_threadgroup_bytes(dkp, simdgroups));
    } else {
        const uint nk = gdr_nk(s.dk);
        const uint3 groups = {(s.dv + GDR_COLS - 1) / GDR_COLS, s.hv, s.b};
        const uint3 tg = {SIMD_W * GDR_COLS, 1, 1};
        emu::dispatch_thread_groups(groups, tg, [&](const emu::Ids& id) {
            if (owners) {
                E::rec_branches(nk)(qkv, gb, state, o, lengths, p, owners,
                                    id.threadgroup_position_in_grid, id.simdgroup_index_in_threadgroup,
                                    id.simdgroups_per_threadgroup, id.thread_index_in_simdgroup);
            } else {
                E::rec(nk)(qkv, gb, state, o, lengths, p, id.threadgroup_position_in_grid,
                                  id.simdgroup_index_in_threadgroup, id.simdgroups_per_threadgroup,
                                  id.thread_index_in_simdgroup);
            }
        });
    }
    return chunked;
}

/// The split delta rule (two dispatches into one packed output) against the composition through
/// the in-place kernel (a zero state, the states' run, their final states copied to the branch
/// rows, the branches' run from those).
template <class T> static void gdr_split_case(const SplitShape& sp, uint hk, uint hv, uint dk, uint dv) {
    const std::string tag = std::string("gated_delta_rule_split_") + Dt<T>::name;
    const uint R = sp.r(), B = sp.b();
    const GdrShape s_shape{R, sp.s, hk, hv, dk, dv}, b_shape{B, sp.t, hk, hv, dk, dv};
    const GdrData ds = gdr_data(s_shape, 0.4f), db = gdr_data(b_shape, 1.9f);
    const size_t head = size_t(hv) * dv, state_row = size_t(hv) * dk * dv;
    const size_t o_s = size_t(R) * sp.s * head, o_all = o_s + size_t(B) * sp.t * head;

    // The split form: packed gates, a state buffer the states' dispatch fills (guard NaNs before:
    // a read of it from the zero-state entry shows), one packed output.
    auto qs = upload<T>(ds.qkv, nullptr);
    auto qb = upload<T>(db.qkv, nullptr);
    Buf<float> gb(ds.gb.size() + db.gb.size());
    std::copy(ds.gb.begin(), ds.gb.end(), gb.data());
    std::copy(db.gb.begin(), db.gb.end(), gb.data() + ds.gb.size());
    Buf<float> state(R * state_row);
    Buf<T> o(o_all);
    Buf<uint> len_s(R), len_b(B), owners(B);
    for (uint i = 0; i < R; ++i) len_s[i] = sp.state_len[i];
    for (uint i = 0; i < B; ++i) len_b[i] = sp.branch_len[i], owners[i] = sp.owners[i];
    const bool chunked_s = gdr_split_part<T>(s_shape, qs.data(), gb.data(), state.data(), o.data(),
                                             len_s.data(), nullptr);
    const bool chunked_b =
        gdr_split_part<T>(b_shape, qb.data(), gb.data() + ds.gb.size(), state.data(), o.data() + o_s,
                          len_b.data(), owners.data());
    qs.check(tag + " states qkv");
    qb.check(tag + " branches qkv");
    gb.check(tag + " gates");
    state.check(tag + " state");
    owners.check(tag + " owners");
    const auto got = download(o, tag + " o");

    // The composition through the in-place kernel, Auto's choice per part.
    std::vector<float> st(R * state_row, 0.0f);
    const GdrOut rs = gdr_emu<T>(s_shape, ds.qkv, ds.gb, st, sp.state_len, GdrKernel::Auto);
    std::vector<float> st_b;
    for (uint o_row : sp.owners)
        st_b.insert(st_b.end(), st.begin() + o_row * state_row, st.begin() + (o_row + 1) * state_row);
    const GdrOut rb = gdr_emu<T>(b_shape, db.qkv, db.gb, st_b, sp.branch_len, GdrKernel::Auto);
    std::vector<double> composed = rs.o;
    composed.insert(composed.end(), rb.o.begin(), rb.o.end());
    std::vector<double> got_state(state.v.begin() + Buf<float>::GUARD,
                                  state.v.begin() + Buf<float>::GUARD + state.n);

    const std::string name = split_name(tag, sp) + (chunked_s ? " chunked" : " recurrent") + "/" +
                             (chunked_b ? "chunked" : "recurrent") + " Dk=" + std::to_string(dk);
    if (chunked_s != rs.chunked || chunked_b != rb.chunked) {
        std::printf("%-58s FAIL (kernel choice differs from the composition's)\n", name.c_str());
        ++g_failures;
    }
    compare(name + " o vs composed", got, composed, F32_ABS, Dt<T>::rel);
    expect_identical(name + " o vs composed", got, composed);
    expect_identical(name + " states' final states", got_state, rs.state);
    gdr_expect_padding_zero(name + " states", s_shape, sp.state_len,
                            std::vector<double>(got.begin(), got.begin() + o_s));
    gdr_expect_padding_zero(name + " branches", b_shape, sp.branch_len,
                            std::vector<double>(got.begin() + o_s, got.end()));
}

static void gdr_split_tests() {
    // Step by step: f32, padded states, a branch of 0 steps, owners out of order.
    gdr_split_case<float>({{37, 20}, 37, {9, 4, 0, 9}, 9, {1, 0, 1, 0}}, 1, 2, 32, 16);
    gdr_split_case<float>({{5, 13, 1}, 13, {3, 3, 1}, 3, {2, 0, 1}}, 2, 2, 40, 12);
    // bf16: both parts chunked (padded, lengths no multiple of the chunk), then chunked states
    // with step-by-step branches.
    gdr_split_case<ushort>({{70, 41}, 70, {66, 50, 13}, 66, {1, 0, 0}}, 1, 2, 32, 16);
    gdr_split_case<ushort>({{70, 64, 3}, 70, {9, 5, 9}, 9, {2, 0, 1}}, 1, 1, 64, 8);
    // f16: Dk padded to the chunked variant, both chunked; then short, step by step.
    gdr_split_case<half>({{65, 30}, 65, {64, 17}, 64, {0, 1}}, 1, 2, 40, 20);
    gdr_split_case<half>({{7, 7}, 7, {2, 1, 2}, 2, {1, 1, 0}}, 1, 2, 32, 16);
}

// ---------------------------------------------------------------- the harness itself
// Broken kernels the harness must reject: each runs in a forked child that must exit with the
// harness's failure status (3), or, for a race, must give schedule-dependent results.
namespace broken {
using namespace metal;
kernel void divergent_simd_sum(device float* out, uint lane) {
    if (lane < 16) {
        out[lane] = simd_sum(1.0f); // only half the simdgroup: undefined on a GPU
    }
}
kernel void skipped_barrier(device float* out, uint tid) {
    if (tid != 5) {
        threadgroup_barrier(mem_flags::mem_device);
    }
    out[tid] = 1.0f;
}
kernel void out_of_bounds(device float* out, uint tid) { out[tid + 1] = 1.0f; }
// Thread 0 publishes a value that the others read without a barrier.
kernel void racy(device float* scratch, device float* out, uint tid) {
    if (tid == 0) scratch[0] = 1.0f;
    out[tid] = scratch[0];
}
} // namespace broken

// Simdgroup matrices: small kernels on the shim's matrix operations, and misuses it must reject.
namespace matrix_checks {
using namespace metal;
// D = X·Y + Z, X [16][24] at row pitch 27, Y [24][16] given as its transpose Yt [16][24] (loaded
// transposed), Z [16][16]: an 8×8 tile of D per simdgroup, 3 products each; D stored row-major and
// transposed. Simdgroup 0 also stores 2·X's first tile (through a diagonal matrix) and a filled one.
kernel void product(const device float* x, const device float* yt, const device float* z,
                    device float* d, device float* dt, device float* extra, uint sg) {
    const uint ti = sg / 2, tj = sg % 2;
    simdgroup_float8x8 acc;
    simdgroup_load(acc, z + ti * 8 * 16 + tj * 8, 16);
    for (uint kk = 0; kk < 3; ++kk) {
        simdgroup_float8x8 a;
        simdgroup_float8x8 b;
        simdgroup_load(a, x + ti * 8 * 27 + kk * 8, 27);
        simdgroup_load(b, yt + tj * 8 * 24 + kk * 8, 24, 0, true);
        simdgroup_multiply_accumulate(acc, a, b, acc);
    }
    simdgroup_store(acc, d + ti * 8 * 16 + tj * 8, 16);
    simdgroup_store(acc, dt + tj * 8 * 16 + ti * 8, 16, 0, true);
    if (sg == 0) {
        simdgroup_float8x8 a;
        simdgroup_float8x8 twice;
        simdgroup_float8x8 two(2.0f);
        simdgroup_load(a, x, 27);
        simdgroup_multiply(twice, a, two);
        simdgroup_store(twice, extra, 8);
        simdgroup_store(make_filled_simdgroup_matrix<float, 8, 8>(1.5f), extra + 64, 8);
    }
}
// A product reached by half the simdgroup.
kernel void divergent_product(device float* out, uint lane) {
    simdgroup_float8x8 a = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
    if (lane < 16) {
        simdgroup_multiply(a, a, a);
    }
    simdgroup_store(a, out, 8);
}
// A load whose pointer differs across lanes.
kernel void nonuniform_load(const device float* src, device float* out, uint lane) {
    simdgroup_float8x8 a;
    simdgroup_load(a, src + lane % 2, 9);
    simdgroup_store(a, out, 8);
}
} // namespace matrix_checks

/// The matrix operations against a plain integer matrix product: small integer inputs, so every
/// f32 sum is exact and the results must match bit for bit.
static void simdgroup_matrix_checks() {
    Buf<float> x(16 * 27), yt(16 * 24), z(16 * 16), d(16 * 16), dt(16 * 16), extra(128);
    for (size_t i = 0; i < x.n; ++i) x[i] = float(int(i * 7 % 17) - 8);
    for (size_t i = 0; i < yt.n; ++i) yt[i] = float(int(i * 5 % 13) - 6);
    for (size_t i = 0; i < z.n; ++i) z[i] = float(int(i * 3 % 11) - 5);
    emu::dispatch_thread_groups(uint3{1, 1, 1}, uint3{128, 1, 1}, [&](const emu::Ids& id) {
        matrix_checks::product(x.data(), yt.data(), z.data(), d.data(), dt.data(), extra.data(),
                               id.simdgroup_index_in_threadgroup);
    });
    d.check("simdgroup product d");
    dt.check("simdgroup product dt");
    extra.check("simdgroup product extra");
    bool ok = true, ok_t = true, ok_extra = true;
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) {
            long long acc = (long long)z[r * 16 + c];
            for (int k = 0; k < 24; ++k) acc += (long long)x[r * 27 + k] * (long long)yt[c * 24 + k];
            ok &= d[r * 16 + c] == float(acc);
            ok_t &= dt[c * 16 + r] == float(acc);
        }
    for (int r = 0; r < 8; ++r)
        for (int c = 0; c < 8; ++c) {
            ok_extra &= extra[r * 8 + c] == 2 * x[r * 27 + c] && extra[64 + r * 8 + c] == 1.5f;
        }
    const auto line = [](const char* what, bool pass) {
        std::printf("%-58s %s\n", what, pass ? "exact ok" : "FAIL");
        g_failures += !pass;
    };
    line("simdgroup matrices: X·Yᵀ(transposed load) + Z, 4 simdgroups", ok);
    line("simdgroup matrices: the same stored transposed", ok_t);
    line("simdgroup matrices: diagonal(2)·product, filled(1.5)", ok_extra);
}

static void expect_rejected(const char* what, void (*run)()) {
    std::fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
        std::freopen("/dev/null", "w", stderr);
        run();
        std::_Exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 3;
    std::printf("%-58s %s\n", (std::string("harness rejects ") + what).c_str(), ok ? "ok" : "FAIL");
    if (!ok) ++g_failures;
}

static void harness_self_checks(uint64_t seed) {
    expect_rejected("a simd_sum reached by half the lanes", [] {
        Buf<float> out(32);
        emu::dispatch_thread_groups(uint3{1, 1, 1}, uint3{32, 1, 1}, [&](const emu::Ids& id) {
            broken::divergent_simd_sum(out.data(), id.thread_index_in_simdgroup);
        });
    });
    expect_rejected("a threadgroup_barrier skipped by a thread", [] {
        Buf<float> out(64);
        emu::dispatch_thread_groups(uint3{1, 1, 1}, uint3{64, 1, 1}, [&](const emu::Ids& id) {
            broken::skipped_barrier(out.data(), id.thread_index_in_threadgroup);
        });
    });
    expect_rejected("an out-of-bounds write", [] {
        Buf<float> out(64);
        emu::dispatch_thread_groups(uint3{1, 1, 1}, uint3{64, 1, 1}, [&](const emu::Ids& id) {
            broken::out_of_bounds(out.data(), id.thread_index_in_threadgroup);
        });
        out.check("out_of_bounds out");
    });
    // The race: in order, thread 0 runs first and every reader sees 1; shuffled, some see the
    // NaN fill. Several seeds, so that thread 0 is not first in all of them.
    bool differs = false;
    for (uint64_t s = seed; s < seed + 4 && !differs; ++s) {
        std::vector<double> runs[2];
        for (int shuffled = 0; shuffled < 2; ++shuffled) {
            Buf<float> scratch(1), out(64);
            emu::options() = {shuffled == 1, s};
            emu::dispatch_thread_groups(uint3{1, 1, 1}, uint3{64, 1, 1}, [&](const emu::Ids& id) {
                broken::racy(scratch.data(), out.data(), id.thread_index_in_threadgroup);
            });
            for (size_t i = 0; i < 64; ++i) runs[shuffled].push_back(out[i]);
        }
        emu::options() = {};
        differs = std::memcmp(runs[0].data(), runs[1].data(), 64 * sizeof(double)) != 0;
    }
    std::printf("%-58s %s\n", "harness shuffle exposes a missing barrier", differs ? "ok" : "FAIL");
    if (!differs) ++g_failures;
    expect_rejected("a simdgroup matrix product reached by half the lanes", [] {
        Buf<float> out(64);
        emu::dispatch_thread_groups(uint3{1, 1, 1}, uint3{32, 1, 1}, [&](const emu::Ids& id) {
            matrix_checks::divergent_product(out.data(), id.thread_index_in_simdgroup);
        });
    });
    expect_rejected("a simdgroup_load whose pointer differs across lanes", [] {
        Buf<float> src(80), out(64);
        for (size_t i = 0; i < src.n; ++i) src[i] = float(i);
        emu::dispatch_thread_groups(uint3{1, 1, 1}, uint3{32, 1, 1}, [&](const emu::Ids& id) {
            matrix_checks::nonuniform_load(src.data(), out.data(), id.thread_index_in_simdgroup);
        });
    });
    simdgroup_matrix_checks();
}

int main(int argc, char** argv) {
    uint64_t seed = 12345;
    for (int i = 1; i < argc; ++i) {
        if (std::string(argv[i]) == "--seed" && i + 1 < argc) {
            seed = std::strtoull(argv[++i], nullptr, 10);
        } else {
            std::fprintf(stderr, "usage: %s [--seed N]\n", argv[0]);
            return 2;
        }
    }
    harness_self_checks(seed);
    const auto start = std::chrono::steady_clock::now();
    gdr_tests(seed);
    gdrc_tests(seed);
    conv_tests(seed);
    fused_op_tests(seed);
    flash_tests(seed);
    gather_tests();
    conv_cached_tests();
    conv_split_tests();
    gdr_split_tests();
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("emulated %llu Metal threads, %llu fiber switches, %.2f s (shuffle seed %llu)\n",
                (unsigned long long)emu::stats().threads, (unsigned long long)emu::stats().switches,
                secs, (unsigned long long)seed);
    if (g_failures > 0) {
        std::printf("%d comparison(s) FAILED\n", g_failures);
        return 1;
    }
    std::printf("all comparisons passed\n");
    return 0;
}
