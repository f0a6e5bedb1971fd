// Gradient averaging through shared memory, for workers on one host.
//
// Horovod's Gloo allreduce moves every byte through the kernel's TCP
// loopback (two copies each way) and waits for its background thread's
// next cycle. Workers on one host can instead share one memory segment:
//
//   segment = | control (one cache line per rank) | slot 0 | ... | slot N-1 | result |
//
// Each call, every rank copies its tensors into its slot; after a barrier
// rank r sums its chunk r of all slots, in rank order, scales it by 1/N
// and writes it to the result; after a second barrier every rank copies
// the whole result out. Every rank therefore returns the same bits, and
// with two ranks the bits Horovod's average gives ((a + b) * 0.5 either
// way). The second barrier also keeps the next call's writes from
// overtaking this call's reads: a rank writes its slot again only after
// every rank has summed, and the result only after every rank has arrived
// at the next call's first barrier, that is copied this call's result out.
//
// A waiting rank spins briefly, then sleeps in short naps (no CPU taken
// from the rank it waits for), and checks every tenth of a second that
// the ranks it waits for are alive: a rank that died (its process gone or
// a zombie) ends the call with an error naming it, instead of a hang.
//
// `TfgptShmAttach` maps the segment (a file under /dev/shm that every rank
// opens; its pages are reserved with posix_fallocate, so a full /dev/shm
// is an error now, not a SIGBUS later); the caller unlinks the file once
// every rank has attached, so nothing is left behind whatever happens.

#include <fcntl.h>
#include <signal.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common.h"

#include "tensorflow/core/framework/common_shape_fns.h"

namespace tfgpt {

using ::tensorflow::OpInputList;
using ::tensorflow::Status;

namespace {

constexpr int kMaxRanks = 256;
constexpr size_t kLine = 64;
constexpr int64_t kAlign = 16;  // floats: one 64-byte line

struct alignas(kLine) RankControl {
  std::atomic<uint64_t> arrived;  // the last barrier this rank reached
  std::atomic<int32_t> pid;
};
static_assert(sizeof(RankControl) == kLine, "one cache line per rank");

int64_t RoundUp(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

size_t ControlBytes() { return RoundUp(kMaxRanks * sizeof(RankControl), 4096); }

size_t SegmentBytes(int size, int64_t capacity) {
  return ControlBytes() + sizeof(float) * static_cast<size_t>(capacity) * (size + 1);
}

struct Segment {
  char* base = nullptr;
  size_t bytes = 0;
  int rank = 0;
  int size = 0;
  int64_t capacity = 0;  // floats per slot
  uint64_t calls = 0;
  std::mutex call;  // one call at a time in this process

  RankControl* control(int r) { return reinterpret_cast<RankControl*>(base) + r; }
  float* slot(int r) {
    return reinterpret_cast<float*>(base + ControlBytes()) + static_cast<size_t>(capacity) * r;
  }
  float* result() { return slot(size); }
  ~Segment() {
    if (base != nullptr) munmap(base, bytes);
  }
};

std::mutex registry_lock;
std::map<int64_t, std::shared_ptr<Segment>>& Registry() {
  static auto* registry = new std::map<int64_t, std::shared_ptr<Segment>>();
  return *registry;
}

// Alive unless the process is gone or a zombie (killed, not yet reaped by
// its launcher: kill(pid, 0) still succeeds on those).
bool Alive(int32_t pid) {
  if (pid <= 0) return true;  // not attached yet: cannot tell
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* file = std::fopen(path, "r");
  if (file == nullptr) return true;  // no procfs: rely on kill()
  char buffer[512];
  size_t read = std::fread(buffer, 1, sizeof(buffer) - 1, file);
  std::fclose(file);
  buffer[read] = '\0';
  const char* close = std::strrchr(buffer, ')');  // "pid (comm) S ..."
  if (close == nullptr || close[1] == '\0' || close[2] == '\0') return true;
  return close[2] != 'Z' && close[2] != 'X';
}

Status Barrier(Segment* segment, uint64_t generation, double timeout_seconds) {
  segment->control(segment->rank)->arrived.store(generation, std::memory_order_release);
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto next_check = start + std::chrono::milliseconds(100);
  double next_warning = 60.0;
  for (int r = 0; r < segment->size; ++r) {
    if (r == segment->rank) continue;
    RankControl* peer = segment->control(r);
    for (int64_t spins = 0; peer->arrived.load(std::memory_order_acquire) < generation; ++spins) {
      if (spins < 4096) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        continue;
      }
      if (spins < 4160) {
        sched_yield();
        continue;
      }
      struct timespec nap = {0, 50 * 1000};
      nanosleep(&nap, nullptr);
      const auto now = Clock::now();
      if (now < next_check) continue;
      next_check = now + std::chrono::milliseconds(100);
      const int32_t pid = peer->pid.load(std::memory_order_acquire);
      if (!Alive(pid)) {
        return ::tensorflow::errors::Aborted(
            "shared-memory allreduce: rank ", r, " (pid ", pid,
            ") exited while rank ", segment->rank, " waited for it");
      }
      const double waited = std::chrono::duration<double>(now - start).count();
      if (waited > timeout_seconds) {
        return ::tensorflow::errors::DeadlineExceeded(
            "shared-memory allreduce: rank ", segment->rank, " waited ", waited,
            " s for rank ", r, " (pid ", pid, "), which is alive but did not arrive");
      }
      if (waited > next_warning) {
        LOG(WARNING) << "tfgpt shared-memory allreduce: rank " << segment->rank
                     << " has waited " << static_cast<int>(waited) << " s for rank " << r;
        next_warning *= 2;
      }
    }
  }
  return ::tensorflow::OkStatus();
}

}  // namespace

REGISTER_OP("TfgptShmAttach")
    .Attr("path: string")
    .Attr("key: int")
    .Attr("rank: int")
    .Attr("size: int")
    .Attr("capacity: int")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs)
    .Doc("Maps the shared segment at `path` for `size` ranks of `capacity` floats each.");

REGISTER_OP("TfgptShmAllreduce")
    .Input("tensors: N * float")
    .Output("averaged: N * float")
    .Attr("N: int >= 1")
    .Attr("key: int")
    .Attr("timeout_seconds: float = 1800")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return ::tensorflow::OkStatus();
    })
    .Doc("Averages `tensors` over the ranks attached to segment `key`.");

class ShmAttachOp : public OpKernel {
 public:
  explicit ShmAttachOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("path", &path_));
    OP_REQUIRES_OK(context, context->GetAttr("key", &key_));
    OP_REQUIRES_OK(context, context->GetAttr("rank", &rank_));
    OP_REQUIRES_OK(context, context->GetAttr("size", &size_));
    OP_REQUIRES_OK(context, context->GetAttr("capacity", &capacity_));
    OP_REQUIRES(context, size_ >= 1 && size_ <= kMaxRanks,
                InvalidArgument("size must be in [1, ", kMaxRanks, "], got ", size_));
    OP_REQUIRES(context, rank_ >= 0 && rank_ < size_,
                InvalidArgument("rank ", rank_, " is not in [0, ", size_, ")"));
    OP_REQUIRES(context, capacity_ >= 1, InvalidArgument("capacity must be positive"));
  }

  void Compute(OpKernelContext* context) override {
    auto segment = std::make_shared<Segment>();
    segment->rank = rank_;
    segment->size = size_;
    segment->capacity = RoundUp(capacity_, kAlign);
    segment->bytes = SegmentBytes(size_, segment->capacity);
    const int fd = open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    OP_REQUIRES(context, fd >= 0,
                ::tensorflow::errors::Unavailable("cannot open ", path_, ": ", std::strerror(errno)));
    // Reserve every page now: a full /dev/shm fails here, not with SIGBUS later.
    const int reserved = posix_fallocate(fd, 0, static_cast<off_t>(segment->bytes));
    if (reserved != 0) {
      close(fd);
      context->SetStatus(::tensorflow::errors::ResourceExhausted(
          "cannot reserve ", segment->bytes >> 20, " MiB in ", path_, ": ",
          std::strerror(reserved)));
      return;
    }
    void* base = mmap(nullptr, segment->bytes, PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_POPULATE, fd, 0);
    const int map_error = errno;
    close(fd);
    OP_REQUIRES(context, base != MAP_FAILED,
                ::tensorflow::errors::Unavailable("cannot map ", path_, ": ",
                                                  std::strerror(map_error)));
    segment->base = static_cast<char*>(base);
    segment->control(rank_)->pid.store(static_cast<int32_t>(getpid()),
                                       std::memory_order_release);
    std::lock_guard<std::mutex> lock(registry_lock);
    Registry()[key_] = std::move(segment);
  }

 private:
  std::string path_;
  int64_t key_, capacity_;
  int rank_, size_;
};

class ShmAllreduceOp : public OpKernel {
 public:
  explicit ShmAllreduceOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("key", &key_));
    OP_REQUIRES_OK(context, context->GetAttr("timeout_seconds", &timeout_seconds_));
  }

  void Compute(OpKernelContext* context) override {
    std::shared_ptr<Segment> segment;
    {
      std::lock_guard<std::mutex> lock(registry_lock);
      auto found = Registry().find(key_);
      OP_REQUIRES(context, found != Registry().end(),
                  ::tensorflow::errors::FailedPrecondition(
                      "shared-memory allreduce: segment ", key_, " is not attached"));
      segment = found->second;
    }
    OpInputList inputs;
    OP_REQUIRES_OK(context, context->input_list("tensors", &inputs));
    int64_t total = 0;
    for (int i = 0; i < inputs.size(); ++i) total += inputs[i].NumElements();
    OP_REQUIRES(context, total <= segment->capacity,
                InvalidArgument("shared-memory allreduce: ", total,
                                " floats do not fit the segment's ", segment->capacity));
    std::lock_guard<std::mutex> call(segment->call);

    float* own = segment->slot(segment->rank);
    int64_t offset = 0;
    for (int i = 0; i < inputs.size(); ++i) {
      const int64_t n = inputs[i].NumElements();
      if (n > 0) std::memcpy(own + offset, inputs[i].flat<float>().data(), n * sizeof(float));
      offset += n;
    }
    const uint64_t generation = 2 * (++segment->calls);
    OP_REQUIRES_OK(context, Barrier(segment.get(), generation - 1, timeout_seconds_));

    const int size = segment->size;
    const int64_t chunk = RoundUp((total + size - 1) / size, kAlign);
    const int64_t begin = std::min(total, chunk * segment->rank);
    const int64_t end = std::min(total, begin + chunk);
    float* result = segment->result();
    const float scale = 1.0f / static_cast<float>(size);
    // In blocks that stay in cache: the ranks' values added in rank order, then scaled.
    constexpr int64_t kBlock = 4096;
    for (int64_t block = begin; block < end; block += kBlock) {
      const int64_t stop = std::min(end, block + kBlock);
      const float* first = segment->slot(0);
      for (int64_t j = block; j < stop; ++j) result[j] = first[j];
      for (int r = 1; r < size; ++r) {
        const float* other = segment->slot(r);
        for (int64_t j = block; j < stop; ++j) result[j] += other[j];
      }
      for (int64_t j = block; j < stop; ++j) result[j] *= scale;
    }
    OP_REQUIRES_OK(context, Barrier(segment.get(), generation, timeout_seconds_));

    offset = 0;
    for (int i = 0; i < inputs.size(); ++i) {
      Tensor* output = nullptr;  // into the input's buffer when nothing else holds it
      OP_REQUIRES_OK(context, context->forward_input_or_allocate_output(
                                  {i}, i, inputs[i].shape(), &output));
      const int64_t n = inputs[i].NumElements();
      if (n > 0) std::memcpy(output->flat<float>().data(), result + offset, n * sizeof(float));
      offset += n;
    }
  }

 private:
  int64_t key_;
  float timeout_seconds_;
};

REGISTER_KERNEL_BUILDER(Name("TfgptShmAttach").Device(DEVICE_CPU), ShmAttachOp);
REGISTER_KERNEL_BUILDER(Name("TfgptShmAllreduce").Device(DEVICE_CPU), ShmAllreduceOp);

}  // namespace tfgpt
