// What would a combine fused into GEMM2's epilogue cost on this card? A standalone probe of the epilogue's
// memory side (no MMAs): each variant turns per-slot rows y[s, :] (s = t*k + j, computed from a hash, so no
// input is read) into out[t, :] = sum_j y[t*k + j, :] for T tokens of H columns.
//
// Rows are visited in "expert order" (a random permutation of the slots, as GEMM2 sees them), in epilogue
// tiles of 128 rows x 256 columns, one block of 256 threads per tile.
//   store    today's GEMM2 store: y -> Y[row, :] in bf16 (16-byte vector stores)
//   combine  today's combine: out[t] = sum_j Y[slot_rows[t*k+j]] in fixed order, fp32, one vector per thread
//   red_i32  fixed point in int32 (2^16 scale): red.global.add.s32 per element into acc[T, H]
//   red_i64  fixed point in int64 (2^32 scale): red.global.add.u64 per element (bit-stable at any order)
//   red_f4   fp32 red.global.add.v4.f32 (float4 atomicAdd, sm_90): order-dependent rounding, for reference
//   cvt_*    acc -> bf16 out, and acc zeroed for the next forward (the fused design's second pass)
//   last     store, then per (token, column tile) counter: the tile that brings it to k sums the token's k
//            rows (fixed order, read back through L2) and writes out; the counter is reset by that tile
// Build: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a probe_combine.cu -o probe_combine
// Run:   ./probe_combine            (prints one table per shape; every check result on stderr and stdout)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CHECK(call)                                                                      \
  do {                                                                                   \
    cudaError_t err_ = (call);                                                           \
    if (err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

constexpr int TILE_ROWS = 128;
constexpr int TILE_COLS = 256;
constexpr int THREADS = 256;
constexpr int VEC = 8;                       // bf16 per 16-byte vector
constexpr int COL_THREADS = TILE_COLS / VEC;  // 32: one warp spans a tile row
constexpr int ROW_STEP = THREADS / COL_THREADS;  // 8 rows per pass of the block

// A value in [-4, 4) with 13 fractional bits: exact in bf16? no (16 significant bits), exact in fp32 and in both
// fixed points, so the int64 sum is the exact sum.
__device__ __forceinline__ float slot_value(uint32_t s, uint32_t h) {
  uint32_t x = s * 2654435761u ^ (h * 40503u + 0x9e3779b9u);
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  return (static_cast<int>(x & 0xffffu) - 32768) * (1.0f / 8192.0f);
}

struct Shape {
  int tokens, top_k, hidden;
};

// ---------------------------------------------------------------------------------------------- kernels
__global__ void store_rows(const int* row_slot, __nv_bfloat16* y, int rows, int hidden) {
  const int row0 = blockIdx.x * TILE_ROWS, col = blockIdx.y * TILE_COLS + (threadIdx.x % COL_THREADS) * VEC;
  if (col >= hidden) return;
  for (int r = row0 + threadIdx.x / COL_THREADS; r < min(row0 + TILE_ROWS, rows); r += ROW_STEP) {
    const int s = row_slot[r];
    alignas(16) __nv_bfloat16 v[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = __float2bfloat16(slot_value(s, col + i));
    *reinterpret_cast<uint4*>(y + static_cast<size_t>(r) * hidden + col) = *reinterpret_cast<uint4*>(v);
  }
}

__global__ void combine_rows(const __nv_bfloat16* y, const int* slot_rows, __nv_bfloat16* out, int tokens, int top_k,
                             int hidden) {
  const int t = blockIdx.x, col = (blockIdx.y * THREADS + threadIdx.x) * VEC;
  if (col >= hidden) return;
  float acc[VEC] = {};
  for (int j = 0; j < top_k; ++j) {
    const int r = slot_rows[t * top_k + j];
    uint4 raw = __ldg(reinterpret_cast<const uint4*>(y + static_cast<size_t>(r) * hidden + col));
    const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] += __bfloat162float(v[i]);
  }
  alignas(16) __nv_bfloat16 o[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) o[i] = __float2bfloat16(acc[i]);
  *reinterpret_cast<uint4*>(out + static_cast<size_t>(t) * hidden + col) = *reinterpret_cast<uint4*>(o);
}

template <typename Acc>
__global__ void red_rows(const int* row_slot, Acc* acc, int rows, int top_k, int hidden) {
  const int row0 = blockIdx.x * TILE_ROWS, col = blockIdx.y * TILE_COLS + (threadIdx.x % COL_THREADS) * VEC;
  if (col >= hidden) return;
  for (int r = row0 + threadIdx.x / COL_THREADS; r < min(row0 + TILE_ROWS, rows); r += ROW_STEP) {
    const int s = row_slot[r];
    Acc* dst = acc + static_cast<size_t>(s / top_k) * hidden + col;
    if constexpr (sizeof(Acc) == 4 && std::is_same<Acc, int>::value) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) atomicAdd(dst + i, __float2int_rn(slot_value(s, col + i) * 65536.0f));
    } else if constexpr (std::is_same<Acc, unsigned long long>::value) {
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        atomicAdd(dst + i, static_cast<unsigned long long>(__double2ll_rn(slot_value(s, col + i) * 4294967296.0)));
    } else {
#pragma unroll
      for (int i = 0; i < VEC; i += 4) {
        float4 v = make_float4(slot_value(s, col + i), slot_value(s, col + i + 1), slot_value(s, col + i + 2),
                               slot_value(s, col + i + 3));
        atomicAdd(reinterpret_cast<float4*>(dst + i), v);
      }
    }
  }
}

template <typename Acc>
__global__ void convert_acc(Acc* acc, __nv_bfloat16* out, size_t n) {
  const size_t i = (static_cast<size_t>(blockIdx.x) * THREADS + threadIdx.x) * VEC;
  if (i >= n) return;
  alignas(16) __nv_bfloat16 o[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
    float x;
    if constexpr (std::is_same<Acc, int>::value) x = static_cast<float>(acc[i + v]) * (1.0f / 65536.0f);
    else if constexpr (std::is_same<Acc, unsigned long long>::value)
      x = static_cast<float>(static_cast<double>(static_cast<long long>(acc[i + v])) * (1.0 / 4294967296.0));
    else x = acc[i + v];
    o[v] = __float2bfloat16(x);
    acc[i + v] = Acc{};
  }
  *reinterpret_cast<uint4*>(out + i) = *reinterpret_cast<uint4*>(o);
}

// store, then per (token, column tile) arrival counter; the tile that completes a token sums its k rows.
__global__ void last_arriver(const int* row_slot, const int* slot_rows, __nv_bfloat16* y, int* counters,
                             __nv_bfloat16* out, int rows, int top_k, int hidden) {
  __shared__ int done_tokens[TILE_ROWS];
  __shared__ int num_done;
  const int row0 = blockIdx.x * TILE_ROWS, tile_col = blockIdx.y * TILE_COLS;
  const int col = tile_col + (threadIdx.x % COL_THREADS) * VEC;
  const int col_tiles = gridDim.y;
  if (threadIdx.x == 0) num_done = 0;
  if (col < hidden) {
    for (int r = row0 + threadIdx.x / COL_THREADS; r < min(row0 + TILE_ROWS, rows); r += ROW_STEP) {
      const int s = row_slot[r];
      alignas(16) __nv_bfloat16 v[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = __float2bfloat16(slot_value(s, col + i));
      *reinterpret_cast<uint4*>(y + static_cast<size_t>(r) * hidden + col) = *reinterpret_cast<uint4*>(v);
    }
  }
  __threadfence();  // this thread's rows are visible device-wide before any counter moves
  __syncthreads();
  if (threadIdx.x < TILE_ROWS && row0 + threadIdx.x < rows) {
    const int t = row_slot[row0 + threadIdx.x] / top_k;
    int* c = counters + static_cast<size_t>(t) * col_tiles + blockIdx.y;
    if (atomicAdd(c, 1) == top_k - 1) {
      *c = 0;  // every other tile of this token has arrived: reset for the next forward
      done_tokens[atomicAdd(&num_done, 1)] = t;
    }
  }
  __syncthreads();
  __threadfence();
  for (int d = threadIdx.x / COL_THREADS; d < num_done; d += ROW_STEP) {
    if (col >= hidden) break;
    const int t = done_tokens[d];
    float acc[VEC] = {};
    for (int j = 0; j < top_k; ++j) {
      const int r = slot_rows[t * top_k + j];
      uint4 raw = __ldcg(reinterpret_cast<const uint4*>(y + static_cast<size_t>(r) * hidden + col));
      const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += __bfloat162float(v[i]);
    }
    alignas(16) __nv_bfloat16 o[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] = __float2bfloat16(acc[i]);
    *reinterpret_cast<uint4*>(out + static_cast<size_t>(t) * hidden + col) = *reinterpret_cast<uint4*>(o);
  }
}

// ---------------------------------------------------------------------------------------------- harness
template <typename F>
static float median_us(F&& launch, int reps) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();
  CHECK(cudaGetLastError());
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000.0f);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

static std::vector<uint16_t> fetch(const __nv_bfloat16* d, size_t n) {
  std::vector<uint16_t> h(n);
  CHECK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
  return h;
}

static float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static int run_shape(const Shape& sh, int reps) {
  const int T = sh.tokens, K = sh.top_k, H = sh.hidden, S = T * K;
  const size_t out_n = static_cast<size_t>(T) * H, y_n = static_cast<size_t>(S) * H;
  std::vector<int> row_slot(S), slot_rows(S);
  for (int s = 0; s < S; ++s) row_slot[s] = s;
  std::mt19937 rng(1234 + T + H);
  std::shuffle(row_slot.begin(), row_slot.end(), rng);
  for (int r = 0; r < S; ++r) slot_rows[row_slot[r]] = r;

  int *d_row_slot, *d_slot_rows, *d_counters;
  __nv_bfloat16 *d_y, *d_out;
  void* d_acc;
  const int col_tiles = (H + TILE_COLS - 1) / TILE_COLS;
  CHECK(cudaMalloc(&d_row_slot, S * 4));
  CHECK(cudaMalloc(&d_slot_rows, S * 4));
  CHECK(cudaMalloc(&d_counters, static_cast<size_t>(T) * col_tiles * 4));
  CHECK(cudaMalloc(&d_y, y_n * 2));
  CHECK(cudaMalloc(&d_out, out_n * 2));
  CHECK(cudaMalloc(&d_acc, out_n * 8));
  CHECK(cudaMemcpy(d_row_slot, row_slot.data(), S * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_slot_rows, slot_rows.data(), S * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemset(d_counters, 0, static_cast<size_t>(T) * col_tiles * 4));
  CHECK(cudaMemset(d_acc, 0, out_n * 8));

  const dim3 tiles((S + TILE_ROWS - 1) / TILE_ROWS, col_tiles);
  const dim3 comb(T, (H + THREADS * VEC - 1) / (THREADS * VEC));
  const int cvt_blocks = static_cast<int>((out_n / VEC + THREADS - 1) / THREADS);
  auto poison = [&] { CHECK(cudaMemset(d_out, 0xff, out_n * 2)); };

  // checks: today's path as the reference of the bit-stable paths
  poison();
  store_rows<<<tiles, THREADS>>>(d_row_slot, d_y, S, H);
  combine_rows<<<comb, THREADS>>>(d_y, d_slot_rows, d_out, T, K, H);
  CHECK(cudaDeviceSynchronize());
  auto ref = fetch(d_out, out_n);
  poison();
  CHECK(cudaMemset(d_y, 0xff, y_n * 2));
  last_arriver<<<tiles, THREADS>>>(d_row_slot, d_slot_rows, d_y, d_counters, d_out, S, K, H);
  CHECK(cudaDeviceSynchronize());
  auto last = fetch(d_out, out_n);
  const bool last_equal = std::memcmp(ref.data(), last.data(), out_n * 2) == 0;
  std::vector<uint16_t> i64[2];
  for (int rep = 0; rep < 2; ++rep) {
    poison();
    red_rows<unsigned long long><<<tiles, THREADS>>>(d_row_slot, static_cast<unsigned long long*>(d_acc), S, K, H);
    convert_acc<unsigned long long><<<cvt_blocks, THREADS>>>(static_cast<unsigned long long*>(d_acc), d_out, out_n);
    CHECK(cudaDeviceSynchronize());
    i64[rep] = fetch(d_out, out_n);
  }
  const bool i64_stable = std::memcmp(i64[0].data(), i64[1].data(), out_n * 2) == 0;
  double worst = 0.0, ref_norm = 0.0, diff_norm = 0.0;  // exact fixed-point sum against the bf16-row sum
  for (size_t i = 0; i < out_n; ++i) {
    const double a = bf16_to_float(ref[i]), b = bf16_to_float(i64[0][i]);
    worst = std::max(worst, std::fabs(a - b));
    ref_norm += a * a;
    diff_norm += (a - b) * (a - b);
  }
  CHECK(cudaMemset(d_acc, 0, out_n * 8));

  auto* acc_i32 = static_cast<int*>(d_acc);
  auto* acc_i64 = static_cast<unsigned long long*>(d_acc);
  auto* acc_f32 = static_cast<float*>(d_acc);
  float t[9];
  t[0] = median_us([&] { store_rows<<<tiles, THREADS>>>(d_row_slot, d_y, S, H); }, reps);
  t[1] = median_us([&] { combine_rows<<<comb, THREADS>>>(d_y, d_slot_rows, d_out, T, K, H); }, reps);
  t[2] = median_us([&] { red_rows<int><<<tiles, THREADS>>>(d_row_slot, acc_i32, S, K, H); }, reps);
  t[3] = median_us([&] { convert_acc<int><<<cvt_blocks, THREADS>>>(acc_i32, d_out, out_n); }, reps);
  t[4] = median_us([&] { red_rows<unsigned long long><<<tiles, THREADS>>>(d_row_slot, acc_i64, S, K, H); }, reps);
  t[5] = median_us([&] { convert_acc<unsigned long long><<<cvt_blocks, THREADS>>>(acc_i64, d_out, out_n); }, reps);
  t[6] = median_us([&] { red_rows<float><<<tiles, THREADS>>>(d_row_slot, acc_f32, S, K, H); }, reps);
  t[7] = median_us([&] { convert_acc<float><<<cvt_blocks, THREADS>>>(acc_f32, d_out, out_n); }, reps);
  t[8] = median_us([&] {
    last_arriver<<<tiles, THREADS>>>(d_row_slot, d_slot_rows, d_y, d_counters, d_out, S, K, H);
  }, reps);
  CHECK(cudaDeviceSynchronize());
  // the timed last-arriver runs must leave the same output (counters reset themselves)
  const bool last_after = std::memcmp(ref.data(), fetch(d_out, out_n).data(), out_n * 2) == 0;

  const double elems = static_cast<double>(y_n);
  std::printf("\nT=%d k=%d H=%d: %d slots, Y %.0f MB, acc int64 %.0f MB\n", T, K, H, S, y_n * 2 / 1e6,
              out_n * 8 / 1e6);
  std::printf("checks: last-arriver bit-equal to store+combine: %s (after %d timed runs: %s); int64 twice "
              "bit-equal: %s; int64 vs bf16 rows: max |diff| %.3g, rel l2 %.3g\n",
              last_equal ? "yes" : "NO", reps, last_after ? "yes" : "NO", i64_stable ? "yes" : "NO", worst,
              std::sqrt(diff_norm / std::max(ref_norm, 1e-30)));
  std::printf("| path | pass 1 us | pass 2 us | sum us | element adds per ns |\n|---|---|---|---|---|\n");
  std::printf("| today: store + combine | %.1f | %.1f | %.1f | |\n", t[0], t[1], t[0] + t[1]);
  std::printf("| red int32 + convert | %.1f | %.1f | %.1f | %.1f |\n", t[2], t[3], t[2] + t[3], elems / t[2] / 1e3);
  std::printf("| red int64 + convert | %.1f | %.1f | %.1f | %.1f |\n", t[4], t[5], t[4] + t[5], elems / t[4] / 1e3);
  std::printf("| red f32x4 + convert (order-dependent) | %.1f | %.1f | %.1f | %.1f |\n", t[6], t[7], t[6] + t[7],
              elems / t[6] / 1e3);
  std::printf("| last arriver (store, count, sum) | %.1f | | %.1f | |\n", t[8], t[8]);
  CHECK(cudaFree(d_row_slot));
  CHECK(cudaFree(d_slot_rows));
  CHECK(cudaFree(d_counters));
  CHECK(cudaFree(d_y));
  CHECK(cudaFree(d_out));
  CHECK(cudaFree(d_acc));
  return (last_equal && last_after && i64_stable) ? 0 : 1;
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  cudaDeviceProp p;
  CHECK(cudaGetDeviceProperties(&p, 0));
  std::printf("%s, %d SMs, L2 %d MB\n", p.name, p.multiProcessorCount, p.l2CacheSize >> 20);
  // the ridge cells: qwen3-30b T=2048 / 8192, qwen3-235b T=2048, gpt-oss T=8192, deepseek-v3 T=8192
  const Shape shapes[] = {{2048, 8, 2048}, {8192, 8, 2048}, {2048, 8, 4096}, {8192, 4, 2880}, {8192, 8, 7168}};
  int bad = 0;
  for (const Shape& s : shapes) bad += run_shape(s, reps);
  std::printf("\n%s\n", bad ? "SOME CHECKS FAILED" : "all checks passed");
  return bad ? 1 : 0;
}
