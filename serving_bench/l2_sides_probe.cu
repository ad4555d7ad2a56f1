// Which SMs share an L2 partition ("side") on this GPU, and which share a GPC. A measurement tool: nvcc on the
// device machine builds it, serving_bench/l2_sides.py runs it and turns its JSON into a side map.
//
//   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a -o /tmp/l2_sides_probe serving_bench/l2_sides_probe.cu
//   /tmp/l2_sides_probe > probe.json
//
// Sides (first-touch latency): the L2 of a Hopper GPU is two partitions; each caches lines for the SMs of the GPCs
// wired to it, and a line that one side holds reaches the other side over the partition fabric. One block per SM
// (one wave, the shared-memory request keeps a second block off every SM). A reference block first reads every
// line of a buffer fresh from DRAM (its side now holds them all); then every block in turn (a ticket in global
// memory, so only one SM measures at a time) times single loads (ld.global.cg, L1 bypassed) of its own lines,
// which no other SM read since the reference did. A block on the reference's side hits its own partition; a block
// on the other side has to fetch part of the lines across (on the H200: a quarter to a half of them, 470 against 300
// cycles). Four passes, the first block and then the last as the reference. Per block: its SM id, the quartiles of
// its loads' cycles and how many lines took 25% longer than its lower quartile.
//
// GPCs: blocks of one thread-block cluster always run in one GPC. Clusters of 16 (non-portable), 8 and 4 blocks,
// each block one SM, record the SM ids of each cluster; the Python side joins SMs seen in one cluster.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr int LINES = 64;             // lines timed per block and pass
constexpr int LINE_STRIDE = 33 * 16;  // 8-byte words between lines (33 x 128 bytes: spreads them over channels)
constexpr int SPIN_SMEM = 150 * 1024; // dynamic shared memory per block: at most one block per SM

__device__ __forceinline__ unsigned smid() {
    unsigned r;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
    return r;
}

// cycles of one L2 load: the second clock read is predicated on the loaded value, so it waits for the load
__device__ __forceinline__ unsigned long long timed_load(const unsigned long long* p) {
    unsigned long long dt;
    asm volatile(
        "{\n\t.reg .pred q;\n\t.reg .u64 t0, t1, v;\n\t"
        "mov.u64 t0, %%clock64;\n\t"
        "ld.global.cg.u64 v, [%1];\n\t"
        "setp.ne.u64 q, v, 12345;\n\t"
        "@q mov.u64 t1, %%clock64;\n\t"
        "@!q mov.u64 t1, 0;\n\t"
        "sub.u64 %0, t1, t0;\n\t}"
        : "=l"(dt) : "l"(p) : "memory");
    return dt;
}

__device__ __forceinline__ int load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release(int* p, int v) {
    asm volatile("st.release.gpu.global.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// buf: blocks * LINES lines (block b's are b * LINES ..), each LINE_STRIDE words apart
__global__ void sides_kernel(const unsigned long long* buf, int* ticket, int reference, unsigned* sm_out,
                             unsigned long long* cycles_out) {
    extern __shared__ unsigned long long scratch[];
    const int b = blockIdx.x, blocks = gridDim.x;
    if (threadIdx.x != 0) return;
    scratch[0] = 0;
    sm_out[b] = smid();
    if (b == reference) {  // the reference reads every line first
        unsigned long long sink = 0;
        for (int i = 0; i < blocks * LINES; ++i) sink += timed_load(buf + (size_t)i * LINE_STRIDE);
        scratch[0] = sink;
        __threadfence();
        store_release(ticket, 0);
        store_release(ticket + 1, 1);  // the reference is done
    }
    while (load_acquire(ticket + 1) == 0) { }
    while (load_acquire(ticket) != b) { }
    unsigned long long t[LINES];
    for (int i = 0; i < LINES; ++i) t[i] = timed_load(buf + (size_t)(b * LINES + i) * LINE_STRIDE);
    for (int i = 0; i < LINES; ++i) cycles_out[(size_t)b * LINES + i] = t[i];
    __threadfence();
    store_release(ticket, b + 1);
}

__global__ void cluster_kernel(unsigned* sm_out) {
    extern __shared__ unsigned long long scratch[];
    if (threadIdx.x == 0) { scratch[0] = 1; sm_out[blockIdx.x] = smid(); }
}

__global__ void evict_kernel(float* p, size_t n) {  // touch a large buffer: the probe's lines leave L2
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] += 1.0f;
}

int main() {
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    const int sms = prop.multiProcessorCount;
    printf("{\"device\": \"%s\", \"sms\": %d, \"l2_bytes\": %d,\n", prop.name, sms, prop.l2CacheSize);

    // ---------------------------------------------------------------- sides
    const size_t words = (size_t)sms * LINES * LINE_STRIDE;
    unsigned long long* buf;
    int* ticket;
    unsigned* sm_d;
    unsigned long long* cyc_d;
    float* evict;
    const size_t evict_n = (size_t)4 * prop.l2CacheSize;  // 16 bytes per L2 byte
    CHECK(cudaMalloc(&buf, words * 8));
    CHECK(cudaMemset(buf, 0, words * 8));
    CHECK(cudaMalloc(&ticket, 8));
    CHECK(cudaMalloc(&sm_d, sms * 4 * 2));
    CHECK(cudaMalloc(&cyc_d, (size_t)sms * LINES * 8));
    CHECK(cudaMalloc(&evict, evict_n * 4));
    CHECK(cudaMemset(evict, 0, evict_n * 4));
    CHECK(cudaFuncSetAttribute(sides_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SPIN_SMEM));
    std::vector<unsigned> sm_h(sms);
    std::vector<unsigned long long> cyc(sms * LINES);
    printf("\"passes\": [\n");
    const int references[4] = {0, sms - 1, 0, sms - 1};
    for (int pass = 0; pass < 4; ++pass) {
        evict_kernel<<<sms * 4, 256>>>(evict, evict_n);
        CHECK(cudaMemset(ticket, 0, 8));
        CHECK(cudaDeviceSynchronize());
        sides_kernel<<<sms, 32, SPIN_SMEM>>>(buf, ticket, references[pass], sm_d, cyc_d);
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaMemcpy(sm_h.data(), sm_d, sms * 4, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(cyc.data(), cyc_d, cyc.size() * 8, cudaMemcpyDeviceToHost));
        printf("{\"reference_block\": %d, \"blocks\": [", references[pass]);
        for (int b = 0; b < sms; ++b) {
            std::vector<unsigned long long> v(cyc.begin() + (size_t)b * LINES, cyc.begin() + (size_t)(b + 1) * LINES);
            std::sort(v.begin(), v.end());
            unsigned long long slow = 0;
            for (auto x : v) slow += 4 * x > 5 * v[LINES / 4];  // lines 25% above the fast quartile (far ones)
            printf("%s{\"sm\": %u, \"median\": %llu, \"q25\": %llu, \"q75\": %llu, \"slow_lines\": %llu}",
                   b ? ", " : "", sm_h[b], v[LINES / 2], v[LINES / 4], v[3 * LINES / 4], slow);
        }
        printf("]}%s\n", pass < 3 ? "," : "");
    }
    printf("],\n");

    // ---------------------------------------------------------------- GPCs
    CHECK(cudaFuncSetAttribute(cluster_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SPIN_SMEM));
    CHECK(cudaFuncSetAttribute(cluster_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    printf("\"clusters\": [\n");
    bool first = true;
    const int sizes[3] = {16, 8, 4};
    for (int s = 0; s < 3; ++s) {
        const int size = sizes[s];
        for (int rep = 0; rep < 4; ++rep) {
            const int clusters = (2 * sms) / size;  // two waves' worth
            unsigned* out;
            CHECK(cudaMalloc(&out, clusters * size * 4));
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(clusters * size);
            cfg.blockDim = dim3(32);
            cfg.dynamicSmemBytes = SPIN_SMEM;
            cudaLaunchAttribute attr;
            attr.id = cudaLaunchAttributeClusterDimension;
            attr.val.clusterDim.x = size;
            attr.val.clusterDim.y = 1;
            attr.val.clusterDim.z = 1;
            cfg.attrs = &attr;
            cfg.numAttrs = 1;
            cudaError_t e = cudaLaunchKernelEx(&cfg, cluster_kernel, out);
            if (e == cudaSuccess) e = cudaDeviceSynchronize();
            if (e != cudaSuccess) {
                fprintf(stderr, "cluster size %d: %s\n", size, cudaGetErrorString(e));
                cudaGetLastError();
                cudaFree(out);
                break;
            }
            std::vector<unsigned> h(clusters * size);
            CHECK(cudaMemcpy(h.data(), out, h.size() * 4, cudaMemcpyDeviceToHost));
            for (int c = 0; c < clusters; ++c) {
                printf("%s[", first ? "" : ",\n");
                first = false;
                for (int r = 0; r < size; ++r) printf("%s%u", r ? ", " : "", h[c * size + r]);
                printf("]");
            }
            CHECK(cudaFree(out));
        }
    }
    printf("\n]}\n");
    return 0;
}
