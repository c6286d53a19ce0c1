// A stand-in for <metal_stdlib> that lets an unchanged .metal kernel compile as C++ (clang,
// -std=c++20) and run on the CPU, so its logic (indexing, algorithm, barriers, simd collectives)
// can be tested on Linux. Written for Kev from scratch; see README.md for what it cannot check.
//
// - Address spaces (`device`, `constant`, `thread`, `threadgroup` on pointers) are erased
//   (`threadgroup` into `register`, see below: compile with -Wno-register);
//   `[[buffer(n)]]`-style attributes are ignored by clang (-Wno-unknown-attributes).
// - Vectors are clang ext_vector_type (swizzles work); `floatN(...)` constructors are macros.
// - `half` is _Float16; bf16 is expected as ushort (as our kernels read it).
// - A threadgroup runs as cooperative fibers (ucontext), one per Metal thread, switching only at
//   `threadgroup_barrier`, `simdgroup_barrier` and simd collectives. A collective is emulated by
//   every lane writing its value to a slot and blocking; when all lanes of the simdgroup wait at
//   the same call (same source line) they are released and each combines all slots.
//   Collectives must be uniform across the simdgroup and barriers across the threadgroup: a lane
//   that exits or waits elsewhere is reported at once (divergence / deadlock), with the lines.
// - Simdgroup matrices (`simdgroup_float8x8`, `simdgroup_half8x8`): each lane holds 2 of the 64
//   elements (which 2 is implementation-defined on Apple GPUs; here row lane / 4, columns
//   2·(lane % 4) and the next), and `simdgroup_load`, `simdgroup_store`,
//   `simdgroup_multiply_accumulate` and `simdgroup_multiply` are collectives like `simd_sum`: every
//   lane hands in its elements (or, for loads and stores, its arguments, which must agree across
//   the simdgroup), and each computes its own elements of the result from all of them.
// - Threadgroups run one after another. `emu::options().shuffle` randomises (with a seed) the
//   order of threadgroups and runs one ready fiber at a time, releasing each collective as soon
//   as its simdgroup arrived; between two threadgroup barriers it picks either any ready fiber
//   at random or, half the time, only fibers of one simdgroup (in a random ranking) until that
//   one blocks at the barrier, so simdgroups run ahead of one another. That exposes
//   order-dependent results (missing barriers, races between threadgroups). In order, every
//   ready fiber runs before any collective is released.
//
// Not supported: function-scope `threadgroup T a[N];` declarations (rewrite them), textures,
// atomics, function constants, non-uniform threadgroups (dispatch_threads); simdgroup matrices other
// than 8×8, `thread_elements()`, and a `matrix_origin` other than 0 (offset the pointer instead).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <ucontext.h>

// ---------------------------------------------------------------- address spaces, qualifiers
#define kernel
#define device
#define constant const
#define thread
// `threadgroup` also names the attribute of a kernel's threadgroup-memory argument,
// `[[threadgroup(0)]]`, so it cannot expand to nothing: `register` is a keyword that clang takes
// both as an (unknown, ignored) attribute name and, with -Wno-register, as a storage class that
// changes nothing on a pointer.
#define threadgroup register
#define METAL_FUNC inline

// ---------------------------------------------------------------- scalar and vector types
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong; // 64-bit on Linux x86-64 / aarch64, as Metal's ulong
#ifndef __FLT16_MAX__
#error "metal-emu needs _Float16 for `half`: use clang >= 15 (e.g. Debian's clang-16)"
#endif
typedef _Float16 half;

#define EMU_VECTORS(T)                                                                         \
    typedef T T##2 __attribute__((ext_vector_type(2)));                                        \
    typedef T T##3 __attribute__((ext_vector_type(3)));                                        \
    typedef T T##4 __attribute__((ext_vector_type(4)));
EMU_VECTORS(float)
EMU_VECTORS(half)
EMU_VECTORS(int)
EMU_VECTORS(uint)
EMU_VECTORS(short)
EMU_VECTORS(ushort)
EMU_VECTORS(char)
EMU_VECTORS(uchar)
#undef EMU_VECTORS
typedef ulong ulong2 __attribute__((ext_vector_type(2))); // simdgroup_load's matrix_origin

namespace emu {

template <class V> struct vec_info {
    static constexpr bool is_vec = false;
};
#define EMU_VEC_INFO(T)                                                                        \
    template <> struct vec_info<T##2> {                                                        \
        static constexpr bool is_vec = true;                                                   \
        static constexpr int n = 2;                                                            \
    };                                                                                         \
    template <> struct vec_info<T##3> {                                                        \
        static constexpr bool is_vec = true;                                                   \
        static constexpr int n = 3;                                                            \
    };                                                                                         \
    template <> struct vec_info<T##4> {                                                        \
        static constexpr bool is_vec = true;                                                   \
        static constexpr int n = 4;                                                            \
    };
EMU_VEC_INFO(float)
EMU_VEC_INFO(half)
EMU_VEC_INFO(int)
EMU_VEC_INFO(uint)
EMU_VEC_INFO(short)
EMU_VEC_INFO(ushort)
EMU_VEC_INFO(char)
EMU_VEC_INFO(uchar)
#undef EMU_VEC_INFO

template <class E, int N> struct vec_of;
#define EMU_VEC_OF(T)                                                                          \
    template <> struct vec_of<T, 2> { using type = T##2; };                                    \
    template <> struct vec_of<T, 3> { using type = T##3; };                                    \
    template <> struct vec_of<T, 4> { using type = T##4; };
EMU_VEC_OF(float)
EMU_VEC_OF(half)
EMU_VEC_OF(int)
EMU_VEC_OF(uint)
EMU_VEC_OF(short)
EMU_VEC_OF(ushort)
EMU_VEC_OF(char)
EMU_VEC_OF(uchar)
#undef EMU_VEC_OF

[[noreturn]] inline void fail(const std::string& msg) {
    std::fprintf(stderr, "metal-emu: %s\n", msg.c_str());
    std::fflush(stdout);
    std::exit(3);
}

// Metal-style vector construction: one scalar broadcasts, otherwise scalars and vectors are
// concatenated and must fill the vector exactly.
template <class E, int N, class... A> typename vec_of<E, N>::type make_vec(A... a) {
    typename vec_of<E, N>::type out{};
    if constexpr (sizeof...(A) == 1 && (!vec_info<A>::is_vec && ...)) {
        for (int i = 0; i < N; ++i) {
            out[i] = E((a, ...));
        }
    } else {
        E flat[16];
        int n = 0;
        auto push = [&](auto x) {
            using X = decltype(x);
            if constexpr (vec_info<X>::is_vec) {
                for (int i = 0; i < vec_info<X>::n; ++i) {
                    flat[n++] = E(x[i]);
                }
            } else {
                flat[n++] = E(x);
            }
        };
        (push(a), ...);
        if (n != N) {
            fail("vector constructor with the wrong number of components");
        }
        for (int i = 0; i < N; ++i) {
            out[i] = flat[i];
        }
    }
    return out;
}

} // namespace emu

// Function-like, so that `float4 x;` declarations are untouched.
#define float2(...) ::emu::make_vec<float, 2>(__VA_ARGS__)
#define float3(...) ::emu::make_vec<float, 3>(__VA_ARGS__)
#define float4(...) ::emu::make_vec<float, 4>(__VA_ARGS__)
#define half2(...) ::emu::make_vec<half, 2>(__VA_ARGS__)
#define half3(...) ::emu::make_vec<half, 3>(__VA_ARGS__)
#define half4(...) ::emu::make_vec<half, 4>(__VA_ARGS__)
#define int2(...) ::emu::make_vec<int, 2>(__VA_ARGS__)
#define int3(...) ::emu::make_vec<int, 3>(__VA_ARGS__)
#define int4(...) ::emu::make_vec<int, 4>(__VA_ARGS__)
#define uint2(...) ::emu::make_vec<uint, 2>(__VA_ARGS__)
#define uint3(...) ::emu::make_vec<uint, 3>(__VA_ARGS__)
#define uint4(...) ::emu::make_vec<uint, 4>(__VA_ARGS__)

// ---------------------------------------------------------------- the fiber scheduler
namespace emu {

/// The values Metal passes through thread-position attributes.
struct Ids {
    uint3 thread_position_in_grid;
    uint3 threadgroup_position_in_grid;
    uint3 thread_position_in_threadgroup;
    uint3 threads_per_threadgroup;
    uint3 threadgroups_per_grid;
    uint thread_index_in_threadgroup;
    uint simdgroup_index_in_threadgroup;
    uint thread_index_in_simdgroup;
    uint simdgroups_per_threadgroup;
    uint threads_per_simdgroup;
    /// The threadgroup's `[[threadgroup(0)]]` memory (null when the dispatch asks for none).
    unsigned char* threadgroup_memory;
};

constexpr uint SIMD_WIDTH = 32;
constexpr size_t STACK_BYTES = 256 * 1024;
constexpr size_t SLOT_BYTES = 32; // the largest value a collective moves (a lane's share of three
                                  // float simdgroup matrices, 24 bytes)

struct Options {
    bool shuffle = false;
    uint64_t seed = 0;
};
inline Options& options() {
    static Options o;
    return o;
}

struct Stats {
    uint64_t threads = 0;
    uint64_t switches = 0;
};
inline Stats& stats() {
    static Stats s;
    return s;
}

enum class State { Ready, AtThreadgroupBarrier, AtSimd, Done };

struct Fiber {
    ucontext_t ctx;
    State state = State::Ready;
    int line = 0;           // source line of the barrier / collective it waits at
    const char* what = "";  // its name
    unsigned collectives = 0;
    Ids ids;
};

struct Group {
    std::vector<Fiber> fibers;
    ucontext_t scheduler;
    size_t current = 0;
    const std::function<void(const Ids&)>* body = nullptr;
    std::vector<unsigned char> slots; // [simdgroup][bank 2][lane 32][SLOT_BYTES]
    std::string name;

    unsigned char* slot(uint sg, unsigned bank, uint lane) {
        return &slots[((sg * 2 + bank) * SIMD_WIDTH + lane) * SLOT_BYTES];
    }
    uint lanes_in(uint sg) const {
        return std::min<uint>(SIMD_WIDTH, uint(fibers.size()) - sg * SIMD_WIDTH);
    }
};

inline Group*& current_group() {
    static Group* g = nullptr;
    return g;
}

inline const char* state_name(State s) {
    switch (s) {
    case State::Ready: return "ready";
    case State::AtThreadgroupBarrier: return "threadgroup_barrier";
    case State::AtSimd: return "simd";
    case State::Done: return "exited";
    }
    return "?";
}

inline std::string describe(const Group& g, size_t from, size_t to) {
    std::string s;
    for (size_t i = from; i < to; ++i) {
        const Fiber& f = g.fibers[i];
        s += "  thread " + std::to_string(i) + ": " + state_name(f.state);
        if (f.state == State::AtSimd || f.state == State::AtThreadgroupBarrier) {
            s += std::string(" ") + f.what + " at line " + std::to_string(f.line);
        }
        s += "\n";
    }
    return s;
}

inline void trampoline() {
    Group& g = *current_group();
    Fiber& me = g.fibers[g.current];
    (*g.body)(me.ids);
    me.state = State::Done;
    // returning resumes uc_link, the scheduler
}

/// Blocks the calling fiber in `state` until the scheduler releases it.
inline void block(State state, int line, const char* what) {
    Group& g = *current_group();
    Fiber& me = g.fibers[g.current];
    me.state = state;
    me.line = line;
    me.what = what;
    stats().switches++;
    swapcontext(&me.ctx, &g.scheduler);
}

/// Releases the waiters of every barrier that all its participants reached; false if none.
/// `threadgroup_released` (if given) says whether that was a threadgroup barrier.
inline bool release(Group& g, bool* threadgroup_released = nullptr) {
    bool released = false;
    const size_t n = g.fibers.size();
    // Threadgroup barriers: every thread of the group must be there, at the same line.
    size_t at_tg = 0, done = 0;
    for (const Fiber& f : g.fibers) {
        at_tg += f.state == State::AtThreadgroupBarrier;
        done += f.state == State::Done;
    }
    if (at_tg > 0 && done > 0) {
        fail(g.name + ": threadgroup_barrier waited for by some threads while others exited:\n" +
             describe(g, 0, n));
    }
    if (at_tg == n) {
        for (const Fiber& f : g.fibers) {
            if (f.line != g.fibers[0].line) {
                fail(g.name + ": threads wait at different threadgroup_barriers:\n" +
                     describe(g, 0, n));
            }
        }
        for (Fiber& f : g.fibers) {
            f.state = State::Ready;
        }
        if (threadgroup_released) {
            *threadgroup_released = true;
        }
        return true;
    }
    // Simd collectives / simdgroup barriers: every lane of the simdgroup, same line and kind.
    const uint sgs = uint((n + SIMD_WIDTH - 1) / SIMD_WIDTH);
    for (uint sg = 0; sg < sgs; ++sg) {
        const size_t from = size_t(sg) * SIMD_WIDTH, to = from + g.lanes_in(sg);
        size_t at = 0, exited = 0;
        for (size_t i = from; i < to; ++i) {
            at += g.fibers[i].state == State::AtSimd;
            exited += g.fibers[i].state == State::Done;
        }
        if (at == 0) {
            continue;
        }
        if (exited > 0) {
            fail(g.name + ": simdgroup " + std::to_string(sg) +
                 ": a collective is waited for by some lanes while others exited "
                 "(collectives must be uniform):\n" +
                 describe(g, from, to));
        }
        if (at < to - from) {
            continue; // others still at a threadgroup barrier: a deadlock unless they move on
        }
        for (size_t i = from; i < to; ++i) {
            const Fiber& f = g.fibers[i];
            if (f.line != g.fibers[from].line || std::strcmp(f.what, g.fibers[from].what) != 0) {
                fail(g.name + ": simdgroup " + std::to_string(sg) +
                     ": lanes wait at different collectives (divergent control flow):\n" +
                     describe(g, from, to));
            }
        }
        for (size_t i = from; i < to; ++i) {
            g.fibers[i].state = State::Ready;
        }
        released = true;
    }
    return released;
}

inline void run_group(Group& g, std::vector<std::unique_ptr<char[]>>& stacks, std::mt19937_64& rng) {
    const size_t n = g.fibers.size();
    for (size_t i = 0; i < n; ++i) {
        Fiber& f = g.fibers[i];
        f.state = State::Ready;
        f.collectives = 0;
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = stacks[i].get();
        f.ctx.uc_stack.ss_size = STACK_BYTES;
        f.ctx.uc_link = &g.scheduler;
        makecontext(&f.ctx, trampoline, 0);
    }
    // The shuffled schedule's policy for the stretch up to the next threadgroup barrier: either
    // any ready fiber, at random, or ("run ahead") only those of the first simdgroup, in a random
    // ranking, that has any, so that one simdgroup gets as far as it can before the others move.
    const uint sgs = uint((n + SIMD_WIDTH - 1) / SIMD_WIDTH);
    std::vector<uint> rank(sgs);
    bool run_ahead = false;
    const auto new_stretch = [&] {
        for (uint i = 0; i < sgs; ++i) rank[i] = i;
        std::shuffle(rank.begin(), rank.end(), rng);
        run_ahead = rng() & 1;
    };
    if (options().shuffle) {
        new_stretch();
    }
    std::vector<size_t> order(n);
    for (;;) {
        order.clear();
        for (size_t i = 0; i < n; ++i) {
            if (g.fibers[i].state == State::Ready) {
                order.push_back(i);
            }
        }
        if (order.empty()) {
            bool all_done = true;
            for (const Fiber& f : g.fibers) {
                all_done &= f.state == State::Done;
            }
            if (all_done) {
                return;
            }
            bool threadgroup_released = false;
            if (!release(g, &threadgroup_released)) {
                fail(g.name + ": deadlock, no thread can proceed:\n" + describe(g, 0, n));
            }
            if (threadgroup_released && options().shuffle) {
                new_stretch();
            }
            continue;
        }
        if (options().shuffle) {
            // One ready fiber at a time, at random, and every collective released as soon as its
            // simdgroup has arrived: simdgroups run ahead of one another up to the next
            // threadgroup barrier, so a missing one shows.
            if (run_ahead) {
                uint first = sgs;
                for (size_t i : order) {
                    const uint sg = uint(i / SIMD_WIDTH);
                    if (first == sgs || rank[sg] < rank[first]) first = sg;
                }
                order.erase(std::remove_if(order.begin(), order.end(),
                                           [&](size_t i) { return i / SIMD_WIDTH != first; }),
                            order.end());
            }
            g.current = order[rng() % order.size()];
            stats().switches++;
            swapcontext(&g.scheduler, &g.fibers[g.current].ctx);
            bool threadgroup_released = false;
            release(g, &threadgroup_released);
            if (threadgroup_released) {
                new_stretch();
            }
            continue;
        }
        for (size_t i : order) {
            g.current = i;
            stats().switches++;
            swapcontext(&g.scheduler, &g.fibers[i].ctx);
        }
    }
}

/// Runs `body` once per thread of a grid of `groups` threadgroups of `tg` threads, as
/// `dispatchThreadgroups:threadsPerThreadgroup:` does, with `threadgroup_bytes` of threadgroup
/// memory per threadgroup (`setThreadgroupMemoryLength:atIndex:0`; `Ids::threadgroup_memory`).
/// That memory starts every threadgroup filled with all-ones bytes (a NaN for floats: a read of
/// an element no thread of the group wrote shows in the results) between guard zones that must
/// stay untouched.
inline void dispatch_thread_groups(uint3 groups, uint3 tg, const std::function<void(const Ids&)>& body,
                                   size_t threadgroup_bytes = 0) {
    const size_t n = size_t(tg.x) * tg.y * tg.z;
    if (n == 0 || n > 1024) {
        fail("threadgroup size " + std::to_string(n) + " outside 1..=1024");
    }
    // Left uninitialised: pages a fiber never touches are never committed.
    std::vector<std::unique_ptr<char[]>> stacks(n);
    for (auto& s : stacks) {
        s.reset(new char[STACK_BYTES]);
    }
    std::vector<uint3> order;
    for (uint z = 0; z < groups.z; ++z)
        for (uint y = 0; y < groups.y; ++y)
            for (uint x = 0; x < groups.x; ++x) {
                uint3 v = {x, y, z};
                order.push_back(v);
            }
    std::mt19937_64 rng(options().seed);
    if (options().shuffle) {
        std::shuffle(order.begin(), order.end(), rng);
    }
    Group g;
    g.body = &body;
    g.fibers.resize(n);
    const uint sgs = uint((n + SIMD_WIDTH - 1) / SIMD_WIDTH);
    g.slots.assign(size_t(sgs) * 2 * SIMD_WIDTH * SLOT_BYTES, 0);
    constexpr size_t GUARD_BYTES = 256;
    std::vector<unsigned char> shared(threadgroup_bytes + 2 * GUARD_BYTES);
    unsigned char* const shared_body = threadgroup_bytes > 0 ? shared.data() + GUARD_BYTES : nullptr;
    current_group() = &g;
    for (const uint3& gp : order) {
        g.name = "threadgroup (" + std::to_string(gp.x) + ", " + std::to_string(gp.y) + ", " +
                 std::to_string(gp.z) + ")";
        std::fill(shared.begin(), shared.end(), 0xFF);
        for (uint z = 0; z < tg.z; ++z)
            for (uint y = 0; y < tg.y; ++y)
                for (uint x = 0; x < tg.x; ++x) {
                    const uint idx = x + y * tg.x + z * tg.x * tg.y;
                    Ids& id = g.fibers[idx].ids;
                    id.thread_position_in_threadgroup = uint3{x, y, z};
                    id.threadgroup_position_in_grid = gp;
                    id.thread_position_in_grid = gp * tg + id.thread_position_in_threadgroup;
                    id.threads_per_threadgroup = tg;
                    id.threadgroups_per_grid = groups;
                    id.thread_index_in_threadgroup = idx;
                    id.simdgroup_index_in_threadgroup = idx / SIMD_WIDTH;
                    id.thread_index_in_simdgroup = idx % SIMD_WIDTH;
                    id.simdgroups_per_threadgroup = sgs;
                    id.threads_per_simdgroup = SIMD_WIDTH;
                    id.threadgroup_memory = shared_body;
                }
        run_group(g, stacks, rng);
        for (size_t i = 0; i < GUARD_BYTES; ++i) {
            if (shared[i] != 0xFF || shared[GUARD_BYTES + threadgroup_bytes + i] != 0xFF) {
                fail(g.name + ": threadgroup memory written out of bounds");
            }
        }
        stats().threads += n;
    }
    current_group() = nullptr;
}

/// The calling lane's value and the values of all lanes of its simdgroup, after all of them
/// reached this collective.
template <class T, class F> T collective(T x, int line, const char* what, F combine) {
    static_assert(sizeof(T) <= SLOT_BYTES, "collective value too large");
    Group* g = current_group();
    if (g == nullptr) {
        fail(std::string(what) + " called outside a dispatch");
    }
    Fiber& me = g->fibers[g->current];
    const uint sg = me.ids.simdgroup_index_in_threadgroup;
    const uint lane = me.ids.thread_index_in_simdgroup;
    const unsigned bank = me.collectives++ & 1; // two banks: a fast lane cannot overwrite
    std::memcpy(g->slot(sg, bank, lane), &x, sizeof(T));
    block(State::AtSimd, line, what);
    const uint lanes = g->lanes_in(sg);
    T vals[SIMD_WIDTH];
    for (uint l = 0; l < lanes; ++l) {
        std::memcpy(&vals[l], g->slot(sg, bank, l), sizeof(T));
    }
    return combine(vals, lanes, lane);
}

/// The calling thread's lane in its simdgroup (inside a dispatch only).
inline uint current_lane(const char* what) {
    Group* g = current_group();
    if (g == nullptr) {
        fail(std::string(what) + " called outside a dispatch");
    }
    return g->fibers[g->current].ids.thread_index_in_simdgroup;
}

} // namespace emu

// ---------------------------------------------------------------- the metal namespace
namespace metal {

template <class To, class From> inline To as_type(From from) {
    static_assert(sizeof(To) == sizeof(From), "as_type between types of different sizes");
    To to;
    std::memcpy(&to, &from, sizeof(To));
    return to;
}

// Math. The float overloads are the C++ library's own (`using std::exp`): libc++ also declares
// them in the global namespace, so a second definition here would be ambiguous under
// `using namespace metal`. Only the half overloads, and what std lacks, are defined here.
#define EMU_UNARY(NAME, EXPR)                                                                  \
    using std::NAME;                                                                           \
    inline half NAME(half h) {                                                                 \
        const float x = float(h);                                                              \
        return half(EXPR);                                                                     \
    }
EMU_UNARY(exp, std::exp(x))
EMU_UNARY(exp2, std::exp2(x))
EMU_UNARY(log, std::log(x))
EMU_UNARY(log2, std::log2(x))
EMU_UNARY(sqrt, std::sqrt(x))
EMU_UNARY(sin, std::sin(x))
EMU_UNARY(cos, std::cos(x))
EMU_UNARY(tanh, std::tanh(x))
EMU_UNARY(fabs, std::fabs(x))
EMU_UNARY(abs, std::fabs(x))
EMU_UNARY(floor, std::floor(x))
EMU_UNARY(ceil, std::ceil(x))
EMU_UNARY(round, std::round(x))
EMU_UNARY(trunc, std::trunc(x))
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline half rsqrt(half h) { return half(1.0f / std::sqrt(float(h))); }
#undef EMU_UNARY
inline float pow(float x, float y) { return std::pow(x, y); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
template <class T> inline T min(T a, T b) { return b < a ? b : a; }
template <class T> inline T max(T a, T b) { return a < b ? b : a; }
template <class T> inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <class T> inline T select(T a, T b, bool c) { return c ? b : a; }
namespace precise {
inline float exp(float x) { return std::exp(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float tanh(float x) { return std::tanh(x); }
} // namespace precise
namespace fast {
inline float exp(float x) { return std::exp(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float tanh(float x) { return std::tanh(x); }
} // namespace fast

// Barriers.
enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }
inline void threadgroup_barrier(mem_flags, int line = __builtin_LINE()) {
    emu::block(emu::State::AtThreadgroupBarrier, line, "threadgroup_barrier");
}
inline void simdgroup_barrier(mem_flags, int line = __builtin_LINE()) {
    emu::collective(0, line, "simdgroup_barrier", [](const int*, uint, uint) { return 0; });
}

// Simd collectives (uniform control flow only).
template <class T> inline T simd_sum(T x, int line = __builtin_LINE()) {
    return emu::collective(x, line, "simd_sum", [](const T* v, uint n, uint) {
        T acc = v[0];
        for (uint l = 1; l < n; ++l) acc += v[l];
        return acc;
    });
}
template <class T> inline T simd_product(T x, int line = __builtin_LINE()) {
    return emu::collective(x, line, "simd_product", [](const T* v, uint n, uint) {
        T acc = v[0];
        for (uint l = 1; l < n; ++l) acc *= v[l];
        return acc;
    });
}
template <class T> inline T simd_max(T x, int line = __builtin_LINE()) {
    return emu::collective(x, line, "simd_max", [](const T* v, uint n, uint) {
        T acc = v[0];
        for (uint l = 1; l < n; ++l) acc = max(acc, v[l]);
        return acc;
    });
}
template <class T> inline T simd_min(T x, int line = __builtin_LINE()) {
    return emu::collective(x, line, "simd_min", [](const T* v, uint n, uint) {
        T acc = v[0];
        for (uint l = 1; l < n; ++l) acc = min(acc, v[l]);
        return acc;
    });
}
template <class T> inline T simd_prefix_inclusive_sum(T x, int line = __builtin_LINE()) {
    return emu::collective(x, line, "simd_prefix_inclusive_sum", [](const T* v, uint, uint me) {
        T acc = v[0];
        for (uint l = 1; l <= me; ++l) acc += v[l];
        return acc;
    });
}
template <class T> inline T simd_prefix_exclusive_sum(T x, int line = __builtin_LINE()) {
    return emu::collective(x, line, "simd_prefix_exclusive_sum", [](const T* v, uint, uint me) {
        T acc = T(0);
        for (uint l = 0; l < me; ++l) acc += v[l];
        return acc;
    });
}
template <class T> inline T simd_broadcast(T x, ushort lane, int line = __builtin_LINE()) {
    return emu::collective(x, line, "simd_broadcast", [lane](const T* v, uint n, uint) {
        return v[lane % n];
    });
}
template <class T> inline T simd_broadcast_first(T x, int line = __builtin_LINE()) {
    return emu::collective(x, line, "simd_broadcast_first", [](const T* v, uint, uint) { return v[0]; });
}
// The shuffles take the source lane as this lane's own argument, so it travels with the value.
template <class T> struct emu_pair {
    T v;
    uint src;
};
template <class T> inline T emu_shuffle(T x, uint src, int line, const char* what) {
    static_assert(sizeof(emu_pair<T>) <= emu::SLOT_BYTES, "shuffle value too large");
    emu_pair<T> p{x, src};
    return emu::collective(p, line, what, [](const emu_pair<T>* v, uint n, uint me) {
               const uint s = v[me].src;
               return emu_pair<T>{s < n ? v[s].v : v[me].v, s};
           }).v;
}
template <class T> inline T simd_shuffle(T x, ushort src, int line = __builtin_LINE()) {
    return emu_shuffle(x, src, line, "simd_shuffle");
}
template <class T> inline T simd_shuffle_xor(T x, ushort mask, int line = __builtin_LINE()) {
    const uint me = emu::current_group()->fibers[emu::current_group()->current].ids.thread_index_in_simdgroup;
    return emu_shuffle(x, me ^ mask, line, "simd_shuffle_xor");
}
template <class T> inline T simd_shuffle_down(T x, ushort delta, int line = __builtin_LINE()) {
    const uint me = emu::current_group()->fibers[emu::current_group()->current].ids.thread_index_in_simdgroup;
    return emu_shuffle(x, me + delta, line, "simd_shuffle_down"); // out of range: own value
}
template <class T> inline T simd_shuffle_up(T x, ushort delta, int line = __builtin_LINE()) {
    const uint me = emu::current_group()->fibers[emu::current_group()->current].ids.thread_index_in_simdgroup;
    return emu_shuffle(x, me >= delta ? me - delta : me, line, "simd_shuffle_up");
}
inline bool simd_all(bool x, int line = __builtin_LINE()) {
    return emu::collective(x, line, "simd_all", [](const bool* v, uint n, uint) {
        bool acc = true;
        for (uint l = 0; l < n; ++l) acc = acc && v[l];
        return acc;
    });
}
inline bool simd_any(bool x, int line = __builtin_LINE()) {
    return emu::collective(x, line, "simd_any", [](const bool* v, uint n, uint) {
        bool acc = false;
        for (uint l = 0; l < n; ++l) acc = acc || v[l];
        return acc;
    });
}

// Simdgroup matrices (MSL spec §6.7). A matrix is a value every lane of a simdgroup holds a share
// of: lane l holds elements 2l and 2l + 1 of the row-major 8×8 matrix (row l / 4). Every
// operation is a collective, so a matrix operation reached by part of a simdgroup, or by lanes at
// different operations, fails as a divergent `simd_sum` does; each lane computes its own
// elements from all lanes' shares. Products add the 8 terms of an element in order, in T
// (float: f32, as an f32 accumulation on the GPU; the GPU's order of those additions is not
// specified).
template <class T, int Cols, int Rows> struct simdgroup_matrix {
    static_assert(Cols == 8 && Rows == 8, "metal-emu models 8x8 simdgroup matrices only");
    T e[2];
    /// Uninitialised on a GPU; NaN here, so reading it shows in the results.
    simdgroup_matrix() {
        e[0] = e[1] = T(NAN);
    }
    /// The diagonal matrix with `dval` on its diagonal.
    explicit simdgroup_matrix(T dval) {
        const uint lane = emu::current_lane("simdgroup_matrix(dval)");
        for (uint i = 0; i < 2; ++i) {
            const uint at = 2 * lane + i;
            e[i] = at / 8 == at % 8 ? dval : T(0);
        }
    }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;

template <class T, int Cols, int Rows> inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
    simdgroup_matrix<T, Cols, Rows> m;
    m.e[0] = m.e[1] = value;
    return m;
}

// A load's or store's arguments, which every lane must pass the same.
struct emu_matrix_access {
    const void* base;
    ulong elements_per_row;
    bool transpose;
};

inline void emu_uniform_access(const emu_matrix_access* v, uint n, const char* what) {
    if (n != emu::SIMD_WIDTH) {
        emu::fail(std::string(what) + " in a simdgroup of fewer than 32 threads");
    }
    for (uint l = 1; l < n; ++l) {
        if (v[l].base != v[0].base || v[l].elements_per_row != v[0].elements_per_row ||
            v[l].transpose != v[0].transpose) {
            emu::fail(std::string(what) + ": lanes pass different pointers, row pitches or transposes");
        }
    }
}

/// Where element (row, col) of the matrix lies in memory: row-major at `elements_per_row`, or,
/// transposed, element (row, col) is memory's (col, row).
inline ulong emu_matrix_index(ulong row, ulong col, ulong elements_per_row, bool transpose) {
    return transpose ? col * elements_per_row + row : row * elements_per_row + col;
}

inline void emu_origin_zero(ulong2 origin, const char* what) {
    if (origin.x != 0 || origin.y != 0) {
        emu::fail(std::string(what) + ": matrix_origin other than 0 is not modelled (offset the pointer)");
    }
}

template <class T, int C, int R>
inline void simdgroup_load(thread simdgroup_matrix<T, C, R>& d, const T* src, ulong elements_per_row = C,
                           ulong2 matrix_origin = 0, bool transpose_matrix = false,
                           int line = __builtin_LINE()) {
    emu_origin_zero(matrix_origin, "simdgroup_load");
    const emu_matrix_access mine{src, elements_per_row, transpose_matrix};
    const uint lane = emu::current_lane("simdgroup_load");
    emu::collective(mine, line, "simdgroup_load", [](const emu_matrix_access* v, uint n, uint) {
        emu_uniform_access(v, n, "simdgroup_load");
        return v[0];
    });
    for (uint i = 0; i < 2; ++i) {
        const uint at = 2 * lane + i;
        d.e[i] = src[emu_matrix_index(at / 8, at % 8, elements_per_row, transpose_matrix)];
    }
}

template <class T, int C, int R>
inline void simdgroup_store(thread simdgroup_matrix<T, C, R> a, T* dst, ulong elements_per_row = C,
                            ulong2 matrix_origin = 0, bool transpose_matrix = false,
                            int line = __builtin_LINE()) {
    emu_origin_zero(matrix_origin, "simdgroup_store");
    const emu_matrix_access mine{dst, elements_per_row, transpose_matrix};
    const uint lane = emu::current_lane("simdgroup_store");
    emu::collective(mine, line, "simdgroup_store", [](const emu_matrix_access* v, uint n, uint) {
        emu_uniform_access(v, n, "simdgroup_store");
        return v[0];
    });
    for (uint i = 0; i < 2; ++i) {
        const uint at = 2 * lane + i;
        dst[emu_matrix_index(at / 8, at % 8, elements_per_row, transpose_matrix)] = a.e[i];
    }
}

template <class T> struct emu_mac_share {
    T a[2], b[2], c[2];
};

/// d = a·b + c: every lane's shares of a, b and c, then this lane's elements of d.
template <class T, int C, int R, int K>
inline void simdgroup_multiply_accumulate(thread simdgroup_matrix<T, C, R>& d,
                                          const thread simdgroup_matrix<T, K, R>& a,
                                          const thread simdgroup_matrix<T, C, K>& b,
                                          const thread simdgroup_matrix<T, C, R>& c,
                                          int line = __builtin_LINE()) {
    const emu_mac_share<T> mine{{a.e[0], a.e[1]}, {b.e[0], b.e[1]}, {c.e[0], c.e[1]}};
    // The result comes back in the share's `a`.
    const emu_mac_share<T> out = emu::collective(mine, line, "simdgroup_multiply_accumulate",
                                                 [](const emu_mac_share<T>* v, uint n, uint me) {
        if (n != emu::SIMD_WIDTH) {
            emu::fail("simdgroup_multiply_accumulate in a simdgroup of fewer than 32 threads");
        }
        T ma[64], mb[64], mc[64];
        for (uint l = 0; l < n; ++l)
            for (uint i = 0; i < 2; ++i) {
                ma[2 * l + i] = v[l].a[i];
                mb[2 * l + i] = v[l].b[i];
                mc[2 * l + i] = v[l].c[i];
            }
        emu_mac_share<T> o = v[me];
        for (uint i = 0; i < 2; ++i) {
            const uint at = 2 * me + i, row = at / 8, col = at % 8;
            T acc = mc[at];
            for (uint k = 0; k < 8; ++k) acc += ma[row * 8 + k] * mb[k * 8 + col];
            o.a[i] = acc;
        }
        return o;
    });
    d.e[0] = out.a[0];
    d.e[1] = out.a[1];
}

/// d = a·b.
template <class T, int C, int R, int K>
inline void simdgroup_multiply(thread simdgroup_matrix<T, C, R>& d, const thread simdgroup_matrix<T, K, R>& a,
                               const thread simdgroup_matrix<T, C, K>& b, int line = __builtin_LINE()) {
    simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<T, C, R>(T(0)), line);
}

} // namespace metal
