// Which CPUs each of torch's OpenMP threads may run on.
//
// Unpinned, the OS may put two of a step's threads on one CPU when another process wakes on theirs (a server's front
// end, once a token); they then take turns on it, each parallel region waiting at its barrier for the thread that is
// not running, while the other CPU idles until the load balancer moves one back, which can take a whole step.
// libgomp keeps its threads from one parallel region to the next, team member i being the same thread each time, so a
// thread placed once stays where it was put for every later region.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <sched.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "ops.h"

void set_thread_cpus(const std::vector<std::vector<int64_t>>& cpus_of_thread) {
  const int num_threads = static_cast<int>(cpus_of_thread.size());
  TORCH_CHECK(num_threads >= 1, "set_thread_cpus: name the CPUs of at least one thread");
  std::vector<cpu_set_t> sets(num_threads);
  for (int i = 0; i < num_threads; ++i) {
    TORCH_CHECK(!cpus_of_thread[i].empty(), "set_thread_cpus: thread ", i, " has no CPU");
    CPU_ZERO(&sets[i]);
    for (int64_t cpu : cpus_of_thread[i]) {
      TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "set_thread_cpus: no CPU ", cpu);
      CPU_SET(cpu, &sets[i]);
    }
  }
  at::set_num_threads(num_threads);
  std::vector<int> errors(num_threads, 0);
  int team = 0;
  // Thread i (the calling thread is 0) sets its own CPUs.
#pragma omp parallel num_threads(num_threads)
  {
    const int i = omp_get_thread_num();
    if (i == 0) team = omp_get_num_threads();
    if (sched_setaffinity(0, sizeof(cpu_set_t), &sets[i]) != 0) errors[i] = errno;
  }
  TORCH_CHECK(team == num_threads, "set_thread_cpus: OpenMP gave ", team, " threads of the ", num_threads, " asked for");
  for (int i = 0; i < num_threads; ++i)
    TORCH_CHECK(errors[i] == 0, "set_thread_cpus: thread ", i, ": ", std::strerror(errors[i]));
}
