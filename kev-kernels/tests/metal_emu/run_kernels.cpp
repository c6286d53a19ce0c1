// Runs Kev's Metal kernels (the unchanged .metal sources) on the CPU through metal_stdlib_emu.h
// and compares them with double-precision loops written here. Prints one line per comparison
// and exits non-zero if any is beyond its tolerance. Built and run by tests/metal_emulated.rs:
//
//   clang++ -std=c++20 -O1 -Wno-unknown-attributes -I tests/metal_emu/include \
//       tests/metal_emu/run_kernels.cpp -o run_kernels && ./run_kernels [--seed N]
//
// The launches mirror src/<op>/metal.rs: entry point names, variant choice (NK), grid and threadgroup
// sizes, and the parameter structs.

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

// ---------------------------------------------------------------- the host's launch constants
// (src/gated_delta_rule/metal.rs: GDR_COLUMNS_PER_GROUP, SIMD_WIDTH, GDR_MAX_DK; src/causal_conv1d/metal.rs: CONV_THREADS_PER_GROUP)
constexpr uint GDR_COLS = 4;
constexpr uint SIMD_W = 32;
constexpr uint CONV_THREADS = 256;
constexpr uint GDR_MAX_DK = 256;

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

struct GdrOut {
    std::vector<double> qkv_seen; // the input as the kernel read it (rounded to T)
    std::vector<double> o;
    std::vector<double> state;
};

/// One launch as src/<op>/metal.rs makes it. `state` is read and updated in place.
template <class T>
static GdrOut gdr_emu(const GdrShape& s, const std::vector<float>& qkv_f, const std::vector<float>& gb_f,
                      std::vector<float>& state, const std::vector<uint>& lengths_in) {
    if (s.dk > GDR_MAX_DK) emu::fail("Dk too large");
    const std::string tag = std::string("gated_delta_rule_") + Dt<T>::name;
    Buf<T> qkv(qkv_f.size());
    Buf<float> gb(gb_f.size()), st(state.size());
    Buf<T> o(size_t(s.b) * s.t * s.hv * s.dv);
    Buf<uint> lengths(s.b);
    GdrOut out;
    for (size_t i = 0; i < qkv_f.size(); ++i) {
        qkv[i] = Dt<T>::from(qkv_f[i]);
        out.qkv_seen.push_back(Dt<T>::to(qkv[i]));
    }
    std::copy(gb_f.begin(), gb_f.end(), gb.data());
    std::copy(state.begin(), state.end(), st.data());
    std::copy(lengths_in.begin(), lengths_in.end(), lengths.data());
    const gdr::GdrParams p{s.b, s.t, s.hk, s.hv, s.dk, s.dv, 1.0f / std::sqrt(float(s.dk)), 1e-6f};
    const auto fn = GdrEntries<T>::get(gdr_nk(s.dk));
    const uint3 groups = {(s.dv + GDR_COLS - 1) / GDR_COLS, s.hv, s.b};
    const uint3 tg = {SIMD_W * GDR_COLS, 1, 1};
    emu::dispatch_thread_groups(groups, tg, [&](const emu::Ids& id) {
        fn(qkv.data(), gb.data(), st.data(), o.data(), lengths.data(), p,
           id.threadgroup_position_in_grid, id.simdgroup_index_in_threadgroup,
           id.simdgroups_per_threadgroup, id.thread_index_in_simdgroup);
    });
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
    conv_tests(seed);
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
