/* A plain read of the demo model's 120 layer linears' bf16 weights (qkv 960 x 576, o 576 x 576, gate_up
 * 3072 x 576, down 576 x 1536, 30 layers, 212 MB in one huge-page buffer) in a batch-1 decode step's call
 * pattern: one OpenMP region per weight, each of 2 threads summing its half with AVX-512 loads; then one region
 * over all of them. Every line of a 256 MiB buffer is touched first, so the weights come from DRAM. Prints ms and
 * GB/s a sweep, 6 sweeps, and the sum read (printed so that the loads are not dropped; the buffer is nearly all
 * zero bytes, so it is a tiny number): the read the linears' kernels could at best match (benchmarks/README.md, "The gate_up linear's store,
 * and the residual add", batch 1).
 *
 *     cc -O3 -march=native -fopenmp benchmarks/probes/linears_read.c -o linears_read && ./linears_read
 */
#define _GNU_SOURCE
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <sys/mman.h>
#include <time.h>
#include <immintrin.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
int main(){
  size_t sizes[4]={960*576*2,576*576*2,3072*576*2,576*1536*2};
  size_t total=0; for(int l=0;l<30;l++) for(int i=0;i<4;i++) total+=sizes[i];
  size_t alloc=(total+(2<<20))&~((size_t)(2<<20)-1);
  char*buf=aligned_alloc(2<<20,alloc); madvise(buf,alloc,MADV_HUGEPAGE);
  for(size_t i=0;i<alloc;i+=4096) buf[i]=1;
  // extra buffer to flush L3
  size_t fl=256<<20; char*flush=aligned_alloc(2<<20,fl); madvise(flush,fl,MADV_HUGEPAGE); for(size_t i=0;i<fl;i+=64) flush[i]=1;
  for(int rep=0;rep<6;rep++){
    __m512 s=_mm512_setzero_ps();
    // flush
    #pragma omp parallel for reduction(+:total)
    for(size_t i=0;i<fl;i+=64) flush[i]++;
    double t0=now(); size_t off=0; float sink=0;
    for(int l=0;l<30;l++) for(int i=0;i<4;i++){
      size_t n=sizes[i]; char*w=buf+off; off+=n;
      float part[2]={0,0};
      #pragma omp parallel num_threads(2)
      { int t=omp_get_thread_num(); size_t lo=n/2*t, hi=t?n:n/2; __m512 a=_mm512_setzero_ps(),b=a;
        for(size_t j=lo;j+128<=hi;j+=128){ a=_mm512_add_ps(a,_mm512_load_ps((float*)(w+j))); b=_mm512_add_ps(b,_mm512_load_ps((float*)(w+j+64)));}
        part[t]=_mm512_reduce_add_ps(_mm512_add_ps(a,b)); }
      sink+=part[0]+part[1];
    }
    double t1=now();
    // one big region
    double t2=now();
    #pragma omp parallel num_threads(2)
    { int t=omp_get_thread_num(); size_t lo=total/2*t, hi=t?total:total/2; __m512 a=_mm512_setzero_ps(),b=a;
      for(size_t j=lo&~127;j+128<=hi;j+=128){ a=_mm512_add_ps(a,_mm512_load_ps((float*)(buf+j))); b=_mm512_add_ps(b,_mm512_load_ps((float*)(buf+j+64)));}
      if(_mm512_reduce_add_ps(_mm512_add_ps(a,b))==12345) printf("x"); }
    double t3=now();
    printf("120 calls: %.2f ms %.1f GB/s   one region: %.2f ms %.1f GB/s  (sum %g)\n",(t1-t0)*1e3,total/(t1-t0)/1e9,(t3-t2)*1e3,total/(t3-t2)/1e9,sink);
  }
}
