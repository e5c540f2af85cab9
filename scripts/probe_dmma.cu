// FP64 tensor-core shapes on the device: each shape's fragment layout checked against a host product
// (layout_*), and its rate from a loop of independent mma on registers (rate_*).
#define G ((threadIdx.x & 31) >> 2)
#define T (threadIdx.x & 3)

__device__ __forceinline__ void mma884(double (&c)[2], double a, double b) {
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                 : "+d"(c[0]), "+d"(c[1]) : "d"(a), "d"(b));
}
__device__ __forceinline__ void mma1684(double (&c)[4], const double (&a)[2], double b) {
    asm volatile("mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3]) : "d"(a[0]), "d"(a[1]), "d"(b));
}
__device__ __forceinline__ void mma1688(double (&c)[4], const double (&a)[4], const double (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
                 : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
}
__device__ __forceinline__ void mma16816(double (&c)[4], const double (&a)[8], const double (&b)[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7,%8,%9,%10,%11}, "
                 "{%12,%13,%14,%15}, {%0,%1,%2,%3};\n"
                 : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
                 : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]),
                   "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
}

// A [16, 16] row-major, B [16, 8] row-major (k, n); out C [16, 8] for each shape (rows 8.. only m16).
// Assumed layouts: A element (row G + 8 (i % 2), k T + 4 (i / 2)) in a[i]; B (k T + 4 i, n G) in b[i];
// C (row G + 8 (i / 2), n 2 T + i % 2) in c[i].
extern "C" __global__ void layout(const double* A, const double* B, double* c884, double* c1684, double* c1688,
                                  double* c16816) {
    double c2[2] = {0.0, 0.0};
    for (int k0 = 0; k0 < 16; k0 += 4) mma884(c2, A[G * 16 + k0 + T], B[(k0 + T) * 8 + G]);
    c884[G * 8 + 2 * T] = c2[0]; c884[G * 8 + 2 * T + 1] = c2[1];
    double c[4] = {0, 0, 0, 0};
    for (int k0 = 0; k0 < 16; k0 += 4) {
        double a[2] = {A[G * 16 + k0 + T], A[(G + 8) * 16 + k0 + T]};
        mma1684(c, a, B[(k0 + T) * 8 + G]);
    }
    for (int i = 0; i < 4; ++i) c1684[(G + 8 * (i / 2)) * 8 + 2 * T + i % 2] = c[i];
    double d[4] = {0, 0, 0, 0};
    for (int k0 = 0; k0 < 16; k0 += 8) {
        double a[4], b[2];
        for (int i = 0; i < 4; ++i) a[i] = A[(G + 8 * (i % 2)) * 16 + k0 + T + 4 * (i / 2)];
        for (int i = 0; i < 2; ++i) b[i] = B[(k0 + T + 4 * i) * 8 + G];
        mma1688(d, a, b);
    }
    for (int i = 0; i < 4; ++i) c1688[(G + 8 * (i / 2)) * 8 + 2 * T + i % 2] = d[i];
    double e[4] = {0, 0, 0, 0};
    {
        double a[8], b[4];
        for (int i = 0; i < 8; ++i) a[i] = A[(G + 8 * (i % 2)) * 16 + T + 4 * (i / 2)];
        for (int i = 0; i < 4; ++i) b[i] = B[(T + 4 * i) * 8 + G];
        mma16816(e, a, b);
    }
    for (int i = 0; i < 4; ++i) c16816[(G + 8 * (i / 2)) * 8 + 2 * T + i % 2] = e[i];
}

// Eight independent accumulators per thread, `iters` rounds; the sum is written so nothing is dropped.
extern "C" __global__ void rate_884(int iters, double* out) {
    double c[8][2] = {};
    double a = threadIdx.x, b = blockIdx.x;
    for (int it = 0; it < iters; ++it)
        for (int j = 0; j < 8; ++j) mma884(c[j], a, b);
    double s = 0; for (int j = 0; j < 8; ++j) s += c[j][0] + c[j][1];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" __global__ void rate_1684(int iters, double* out) {
    double c[8][4] = {};
    double a[2] = {(double)threadIdx.x, 1.0}, b = blockIdx.x;
    for (int it = 0; it < iters; ++it)
        for (int j = 0; j < 8; ++j) mma1684(c[j], a, b);
    double s = 0; for (int j = 0; j < 8; ++j) s += c[j][0] + c[j][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" __global__ void rate_1688(int iters, double* out) {
    double c[8][4] = {};
    double a[4] = {(double)threadIdx.x, 1.0, 2.0, 3.0}, b[2] = {(double)blockIdx.x, 1.0};
    for (int it = 0; it < iters; ++it)
        for (int j = 0; j < 8; ++j) mma1688(c[j], a, b);
    double s = 0; for (int j = 0; j < 8; ++j) s += c[j][0] + c[j][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
extern "C" __global__ void rate_16816(int iters, double* out) {
    double c[4][4] = {};
    double a[8] = {(double)threadIdx.x, 1, 2, 3, 4, 5, 6, 7}, b[4] = {(double)blockIdx.x, 1, 2, 3};
    for (int it = 0; it < iters; ++it)
        for (int j = 0; j < 4; ++j) mma16816(c[j], a, b);
    double s = 0; for (int j = 0; j < 4; ++j) s += c[j][0] + c[j][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
