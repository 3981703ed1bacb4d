// Event loop of the delay line. One thread serves both directions: ppoll wakes it when a
// packet arrives or when the oldest queued packet is due, it reads a batch straight into
// the ring and writes out everything whose release time has passed.
#include "delay_line.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <stdexcept>

#include "delay_queue.h"

namespace pddcore::wan {
namespace {

constexpr uint64_t kMagic = 0x7064646c;  // "pddl"
constexpr uint64_t kStateRunning = 1;
constexpr uint64_t kStateStopped = 2;
constexpr int kReadBatch = 64;  // packets read from one fd before serving the other

enum LaneStat : size_t {
  kReceivedPackets,
  kReceivedBytes,
  kForwardedPackets,
  kForwardedBytes,
  kDroppedLoss,
  kDroppedOverflow,
  kWriteErrors,
  kQueuePackets,
  kQueueBytes,
  kMaxQueuePackets,
  kLaneStatCount
};
constexpr const char* kLaneStatNames[kLaneStatCount] = {
    "received_packets", "received_bytes", "forwarded_packets", "forwarded_bytes", "dropped_loss",
    "dropped_overflow", "write_errors",   "queue_packets",     "queue_bytes",     "max_queue_packets"};
enum HeaderStat : size_t { kMagicSlot, kStateSlot, kLoopsSlot, kHeaderCount };
constexpr const char* kHeaderNames[kHeaderCount] = {"magic", "state", "loops"};

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

void publish(uint64_t* slot, uint64_t value) { __atomic_store_n(slot, value, __ATOMIC_RELAXED); }

void set_nonblocking(int fd) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
    throw std::runtime_error(std::string("delay line: fcntl(O_NONBLOCK): ") + std::strerror(errno));
}

struct Lane {
  Lane(int in, int out, const DelayLineConfig& c, uint64_t seed)
      : in_fd(in), out_fd(out), queue(c.queue_bytes), policy(c.delay_ns, c.jitter_ns, c.loss, seed) {}

  // Reads up to kReadBatch packets that arrived by `now`.
  void read_batch(uint64_t now, uint8_t* scratch) {
    for (int i = 0; i < kReadBatch; ++i) {
      uint8_t* slot = queue.reserve();
      const ssize_t n = read(in_fd, slot ? slot : scratch, DelayQueue::kMaxPacket);
      if (n <= 0) return;  // EAGAIN: drained; other errors surface as POLLERR
      ++stats[kReceivedPackets];
      stats[kReceivedBytes] += static_cast<uint64_t>(n);
      if (!slot) {
        ++stats[kDroppedOverflow];
      } else if (policy.lose()) {
        ++stats[kDroppedLoss];
      } else {
        queue.commit(static_cast<uint32_t>(n), policy.release_at(now));
      }
    }
  }

  // Writes every packet due by `now`; returns the next release time (0: queue empty or
  // `blocked`, waiting for out_fd to take more).
  uint64_t release_due(uint64_t now) {
    blocked = false;
    while (!queue.empty()) {
      const DelayQueue::Packet& p = queue.front();
      if (p.release_ns > now) return p.release_ns;
      const ssize_t n = write(out_fd, queue.data(p), p.length);
      if (n < 0 && errno == EAGAIN) {
        blocked = true;
        return 0;
      }
      if (n == static_cast<ssize_t>(p.length)) {
        ++stats[kForwardedPackets];
        stats[kForwardedBytes] += p.length;
      } else {
        ++stats[kWriteErrors];
      }
      queue.pop();
    }
    return 0;
  }

  void publish_to(uint64_t* out) {
    stats[kQueuePackets] = queue.packets();
    stats[kQueueBytes] = queue.queued_bytes();
    if (stats[kQueuePackets] > stats[kMaxQueuePackets]) stats[kMaxQueuePackets] = stats[kQueuePackets];
    for (size_t i = 0; i < kLaneStatCount; ++i) publish(out + i, stats[i]);
  }

  int in_fd;
  int out_fd;
  bool blocked = false;
  DelayQueue queue;
  ReleasePolicy policy;
  uint64_t stats[kLaneStatCount] = {};
};

void validate(const DelayLineConfig& c, size_t stats_len) {
  for (const int fd : {c.fd_a, c.fd_b, c.stop_fd})
    if (fd < 0 || fcntl(fd, F_GETFD) < 0) throw std::invalid_argument("delay line: invalid file descriptor " + std::to_string(fd));
  if (c.fd_a == c.fd_b) throw std::invalid_argument("delay line: fd_a and fd_b must differ");
  if (stats_len < delay_line_stat_names().size())
    throw std::invalid_argument("delay line: stats array needs " + std::to_string(delay_line_stat_names().size()) + " values");
  if (c.cpu < -1 || c.cpu >= CPU_SETSIZE) throw std::invalid_argument("delay line: bad cpu index");
}

}  // namespace

const std::vector<std::string>& delay_line_stat_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v(std::begin(kHeaderNames), std::end(kHeaderNames));
    for (const char* lane : {"a_to_b.", "b_to_a."})
      for (const char* stat : kLaneStatNames) v.push_back(std::string(lane) + stat);
    return v;
  }();
  return names;
}

void run_delay_line(const DelayLineConfig& config, uint64_t* stats, size_t stats_len) {
  validate(config, stats_len);
  Lane lanes[2] = {Lane(config.fd_a, config.fd_b, config, config.seed),
                   Lane(config.fd_b, config.fd_a, config, config.seed ^ 0xA5A5A5A5A5A5A5A5ull)};
  set_nonblocking(config.fd_a);
  set_nonblocking(config.fd_b);
  if (config.cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(config.cpu, &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0)
      throw std::runtime_error(std::string("delay line: sched_setaffinity: ") + std::strerror(errno));
  }
  prctl(PR_SET_TIMERSLACK, 1UL);  // wake-ups within microseconds, not the default 50 us
  std::vector<uint8_t> scratch(DelayQueue::kMaxPacket);  // sink for packets that find the queue full

  publish(stats + kMagicSlot, kMagic);
  publish(stats + kStateSlot, kStateRunning);
  uint64_t loops = 0;
  pollfd fds[3] = {{config.fd_a, POLLIN, 0}, {config.fd_b, POLLIN, 0}, {config.stop_fd, POLLIN, 0}};
  for (;;) {
    uint64_t now = now_ns();
    uint64_t next = 0;
    for (Lane& lane : lanes) {
      const uint64_t due = lane.release_due(now);
      if (due && (!next || due < next)) next = due;
    }
    // Each fd is the input of one lane and the output of the other.
    fds[0].events = static_cast<short>(POLLIN | (lanes[1].blocked ? POLLOUT : 0));
    fds[1].events = static_cast<short>(POLLIN | (lanes[0].blocked ? POLLOUT : 0));
    timespec timeout{};
    if (next) {
      const uint64_t wait = next > now ? next - now : 0;
      timeout.tv_sec = static_cast<time_t>(wait / 1000000000ull);
      timeout.tv_nsec = static_cast<long>(wait % 1000000000ull);
    }
    lanes[0].publish_to(stats + kHeaderCount);  // before sleeping: readers see the latest counts
    lanes[1].publish_to(stats + kHeaderCount + kLaneStatCount);
    publish(stats + kLoopsSlot, ++loops);
    const int ready = ppoll(fds, 3, next ? &timeout : nullptr, nullptr);
    if (ready < 0 && errno != EINTR)
      throw std::runtime_error(std::string("delay line: ppoll: ") + std::strerror(errno));
    if (ready > 0) {
      if (fds[2].revents) break;
      for (int i = 0; i < 2; ++i)
        if (fds[i].revents & (POLLERR | POLLHUP | POLLNVAL))
          throw std::runtime_error("delay line: device " + std::to_string(fds[i].fd) + " failed");
      now = now_ns();
      for (int i = 0; i < 2; ++i)
        if (fds[i].revents & POLLIN) lanes[i].read_batch(now, scratch.data());
    }
  }
  lanes[0].publish_to(stats + kHeaderCount);
  lanes[1].publish_to(stats + kHeaderCount + kLaneStatCount);
  publish(stats + kStateSlot, kStateStopped);
}

}  // namespace pddcore::wan
