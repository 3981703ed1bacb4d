// Closed-loop tests of DelayPacer against a fluid model of a bottleneck link: a FIFO queue
// served at the link rate, a sender that overruns the link whenever it is not paced (as a
// bulk TCP flow does), and RTT and acknowledged-bytes counts that reach the sender a
// round trip late, the RTT smoothed like the kernel's. A small message sent beside the bulk
// (the priority lane) waits behind the FIFO queue, then crosses the path one way: its delay
// is half the base RTT plus the queue at the moment it is sent. Built and run by tests/test_delay_pacer.py;
// one case per invocation: `delay_pacer_test <case>`, exit status 0 on success.
#include "transport/tcp/delay_pacer.h"

#include <cmath>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>

#include "check.h"

using pddcore::transfer::DelayPacer;
using pddcore::transfer::PathSample;

namespace {

constexpr int64_t kStepNs = 100'000;  // 0.1 ms
constexpr int kConnections = 4;

struct Link {
  double rate_Bps;
  double base_rtt_s;
  double buffer_s;       // queue capacity, in seconds at the link rate
  double burst_s = 0;    // every 7 ms, one connection's RTT samples run this much higher for 1 ms (a TSO burst)
  double foreign_s = 0;  // added to every RTT sample: delay the link does not cause (a busy host)
};

// What a run looked like over its measured stretch; a message's delay is one way, sent at each step.
struct Outcome {
  double mean_queue_s = 0, max_queue_s = 0, utilization = 0, mean_message_s = 0, max_message_s = 0;
};

// Runs `seconds` of the loop, with `link_at(t)` the link at time t; measures from `from_s`.
// Without a pacer (nullptr) the bulk sender is never paced.
Outcome simulate(DelayPacer* pacer, const std::function<Link(double)>& link_at, double seconds, double from_s) {
  double queue_bytes = 0, acked = 0;
  double srtt[kConnections] = {};
  std::deque<std::pair<double, double>> in_flight;  // (queue delay, delivered rate) as sent, oldest first
  Outcome out;
  double delivered_sum = 0, capacity_sum = 0, queue_sum = 0, message_sum = 0;
  int measured = 0;
  for (int64_t now = 0; now < static_cast<int64_t>(seconds * 1e9); now += kStepNs) {
    const double t = now * 1e-9, dt = kStepNs * 1e-9;
    const Link link = link_at(t);
    const double paced_Bps = pacer != nullptr ? pacer->rate_Bps() : 0;
    const double send = paced_Bps > 0 ? paced_Bps : 2 * link.rate_Bps;
    queue_bytes = std::clamp(queue_bytes + (send - link.rate_Bps) * dt, 0.0, link.buffer_s * link.rate_Bps);
    const double delivered = queue_bytes > 0 ? link.rate_Bps : std::min(send, link.rate_Bps);
    const double queue_s = queue_bytes / link.rate_Bps;
    // Feedback arrives one round trip later. Each step one connection takes an RTT sample
    // into its srtt, the kernel's 1/8 EWMA.
    in_flight.emplace_back(queue_s, delivered);
    const size_t lag = static_cast<size_t>((link.base_rtt_s + link.foreign_s + queue_s) / dt);
    while (in_flight.size() > lag + 1) in_flight.pop_front();
    acked += in_flight.front().second * dt;
    const int64_t step = now / kStepNs;
    const int sampled = static_cast<int>(step % kConnections);
    const bool in_burst = now % 7'000'000 < 1'000'000 && sampled == (now / 7'000'000) % kConnections;
    const double rtt = link.base_rtt_s + in_flight.front().first + (in_burst ? link.burst_s : 0) + link.foreign_s;
    srtt[sampled] = srtt[sampled] == 0 ? rtt : srtt[sampled] + (rtt - srtt[sampled]) / 8;
    if (pacer != nullptr && now % 1'000'000 == 0)
      for (int c = 0; c < kConnections; ++c)
        pacer->observe(c, PathSample{srtt[c], link.base_rtt_s, static_cast<uint64_t>(acked / kConnections)}, now);
    if (t >= from_s) {
      const double message_s = link.base_rtt_s / 2 + queue_s;
      delivered_sum += delivered;
      capacity_sum += link.rate_Bps;
      queue_sum += queue_s;
      message_sum += message_s;
      out.max_queue_s = std::max(out.max_queue_s, queue_s);
      out.max_message_s = std::max(out.max_message_s, message_s);
      ++measured;
    }
  }
  out.mean_queue_s = queue_sum / measured;
  out.mean_message_s = message_sum / measured;
  out.utilization = delivered_sum / capacity_sum;
  std::printf("queue mean %.2f ms, max %.2f ms; message mean %.2f ms, max %.2f ms; utilization %.3f; rate %.3g B/s\n",
              out.mean_queue_s * 1e3, out.max_queue_s * 1e3, out.mean_message_s * 1e3, out.max_message_s * 1e3,
              out.utilization, pacer != nullptr ? pacer->rate_Bps() : 0.0);
  return out;
}

// The queue settles near the target (neither far above nor drained) and the link stays busy.
void check_settled(const Outcome& o, double target_s) {
  CHECK(o.mean_queue_s > 0.5 * target_s);
  CHECK(o.mean_queue_s < 1.5 * target_s);
  CHECK(o.max_queue_s < 4 * target_s);
  CHECK(o.utilization > 0.95);
}

void long_rtt() {  // 1 Gbit/s, 50 ms RTT, a buffer of one BDP: unpaced, the queue would sit at 50 ms
  DelayPacer pacer(0.005, kConnections);
  check_settled(simulate(&pacer, [](double) { return Link{125e6, 0.050, 0.050}; }, 20, 10), 0.005);
}

void short_rtt() {  // 10 Gbit/s, 2 ms RTT
  DelayPacer pacer(0.001, kConnections);
  check_settled(simulate(&pacer, [](double) { return Link{1.25e9, 0.002, 0.004}; }, 10, 5), 0.001);
}

void bursty_short_rtt() {  // 1 Gbit/s, 0.2 ms RTT, passing RTT spikes above the target: no collapse
  DelayPacer pacer(0.002, kConnections);
  check_settled(simulate(&pacer, [](double) { return Link{125e6, 0.0002, 0.010, 0.030}; }, 10, 5), 0.002);
}

void foreign_delay() {  // from 5 s on, RTTs run 8 ms high for reasons of the host: the pacer backs off
  // (it cannot tell) down to its floor, not to nothing
  DelayPacer pacer(0.002, kConnections);
  const Outcome o = simulate(
      &pacer, [](double t) { return Link{125e6, 0.001, 0.010, 0, t < 5 ? 0.0 : 0.008}; }, 15, 8);
  CHECK(o.utilization > 0.2);
  CHECK(pacer.rate_Bps() >= DelayPacer::kFloorShare * 125e6 * 0.99);
}

void capacity_drop() {  // the link halves at 10 s (other traffic): the queue is drained again
  DelayPacer pacer(0.005, kConnections);
  check_settled(simulate(&pacer, [](double t) { return Link{t < 10 ? 125e6 : 62.5e6, 0.050, 0.100}; }, 20, 13), 0.005);
}

void capacity_rise() {  // the link doubles at 10 s: probing finds the new rate
  DelayPacer pacer(0.005, kConnections);
  check_settled(simulate(&pacer, [](double t) { return Link{t < 10 ? 62.5e6 : 125e6, 0.050, 0.050}; }, 20, 13), 0.005);
}

// The pacer's point: a small message beside paced bulk waits about as long as on the idle
// path. 1 Gbit/s, 50 ms RTT, a buffer of one BDP: the message's idle one-way delay is 25 ms.
void message_latency_under_bulk() {
  const auto link = [](double) { return Link{125e6, 0.050, 0.050}; };
  const double idle_s = 0.025, target_s = 0.005;
  // Unpaced, the bulk keeps the buffer full and the message waits behind all of it (3x idle):
  // what the model must show for the paced run below to mean anything.
  const Outcome unpaced = simulate(nullptr, link, 20, 10);
  CHECK(unpaced.mean_message_s > 2.8 * idle_s);
  DelayPacer pacer(target_s, kConnections);
  const Outcome paced = simulate(&pacer, link, 20, 10);
  CHECK(paced.utilization > 0.95);                           // the bulk still fills the link
  CHECK(paced.mean_message_s < idle_s + 1.5 * target_s);     // 1.3x idle at most, on average
  CHECK(paced.max_message_s < idle_s + 4 * target_s);        // and never beyond 1.8x idle
}

void unpaced_until_a_queue() {  // an uncongested path is never slowed
  DelayPacer pacer(0.005, 1);
  for (int64_t now = 0; now < 1'000'000'000; now += 1'000'000) {
    pacer.observe(0, PathSample{0.0101, 0.0100, static_cast<uint64_t>(now / 10)}, now);  // 100 MB/s
    CHECK(pacer.reserve(1 << 20, now) == 0);
  }
  CHECK(pacer.rate_Bps() == 0);
  CHECK(std::abs(pacer.queue_delay_s() - 0.0001) < 1e-9);
}

void token_bucket() {  // once paced, reserve() spaces sends at the rate
  DelayPacer pacer(0.001, 1);
  int64_t now = 0;
  for (; now <= 60'000'000; now += 1'000'000) {  // a 10 ms queue at 100 MB/s: pacing starts
    pacer.reserve(100'000, now);
    pacer.observe(0, PathSample{0.020, 0.010, static_cast<uint64_t>(now / 10)}, now);
  }
  const double rate = pacer.rate_Bps();
  CHECK(rate > 0 && rate < 1e8);
  int64_t waited = 0;
  for (int i = 0; i < 1000; ++i) {
    const int64_t wait = pacer.reserve(65536, now);
    waited += wait;
    now += wait;
  }
  const double expected_ns = 1000 * 65536 / rate * 1e9;
  CHECK(std::abs(waited - expected_ns) < 0.02 * expected_ns + 10'000'000);  // minus the burst allowance
}

void bad_arguments() {
  bool threw = false;
  try {
    DelayPacer(0, 1);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  threw = false;
  try {
    DelayPacer(0.01, 0);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
  DelayPacer pacer(0.01, 1);
  pacer.observe(5, PathSample{0.1, 0.01, 1000}, 0);  // unknown connection, bad samples: ignored
  pacer.observe(0, PathSample{0, 0, 1000}, 0);
  CHECK(pacer.rate_Bps() == 0 && pacer.link_rate_Bps() == 0);
}

}  // namespace

int main(int argc, char** argv) {
  const std::map<std::string, std::function<void()>> cases = {
      {"long_rtt", long_rtt},
      {"short_rtt", short_rtt},
      {"bursty_short_rtt", bursty_short_rtt},
      {"foreign_delay", foreign_delay},
      {"capacity_drop", capacity_drop},
      {"capacity_rise", capacity_rise},
      {"message_latency_under_bulk", message_latency_under_bulk},
      {"unpaced_until_a_queue", unpaced_until_a_queue},
      {"token_bucket", token_bucket},
      {"bad_arguments", bad_arguments},
  };
  return run_case_main(argc, argv, cases);
}
