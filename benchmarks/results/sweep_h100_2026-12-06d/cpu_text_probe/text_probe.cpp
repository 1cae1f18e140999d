// What MLX 0.32's cuda_kernel does with a kernel's text on every call, timed on this CPU: builds
// it with an ostringstream (build_kernel) and hashes it with std::hash (CustomKernel::eval_gpu).
// 35 000 bytes: the GEMM kernel text before _launch.prune.  g++ -O2 text_probe.cpp -o p && ./p
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
int main() {
  std::string s(35000, 'a');
  for (size_t i = 0; i < s.size(); ++i) s[i] = 'a' + (i * 7) % 26;
  size_t acc = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 10000; ++i) {
    s[i % 100]++;
    acc += std::hash<std::string>{}(s);
  }
  auto t1 = std::chrono::steady_clock::now();
  for (int i = 0; i < 10000; ++i) {
    std::ostringstream o;
    o << s << "kernel body" << i;
    std::string k = o.str();
    acc += k.size();
    std::string c = k;
    acc += c[5];
  }
  auto t2 = std::chrono::steady_clock::now();
  printf("hash %.2f us, build %.2f us (%zu)\n",
         std::chrono::duration<double, std::micro>(t1 - t0).count() / 10000,
         std::chrono::duration<double, std::micro>(t2 - t1).count() / 10000, acc % 7);
}
