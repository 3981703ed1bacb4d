// DeliveryMeter against hand-made TCP_INFO readings: what it integrates, what it leaves out.
// Built and run by tests/test_delivery_meter.py; `delivery_meter_test <case>`, exit 0 on success.
#include "transport/tcp/delivery_meter.h"

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "check.h"

using pddcore::transfer::DeliveryMeter;
using pddcore::transfer::PathSample;

namespace {

constexpr int64_t kMs = 1'000'000;
constexpr double kSrtt = 0.040;

// A connection delivering at `rate_Bps`, its latest sample flagged or not.
PathSample delivering(uint64_t acked, double rate_Bps, bool app_limited = false) {
  PathSample s{kSrtt, 0.020, acked};
  s.delivery_rate_Bps = rate_Bps;
  s.delivery_app_limited = app_limited;
  return s;
}

bool near(double got, double want, double tolerance) { return std::fabs(got - want) <= tolerance * want; }

// `connections` streams sharing `link_Bps` equally, observed every millisecond from `from_ns`
// for `span_ns`; acked counts continue from `acked` (updated).
void busy_stretch(DeliveryMeter& meter, std::vector<uint64_t>& acked, double link_Bps, int64_t from_ns,
                  int64_t span_ns) {
  const double share = link_Bps / static_cast<double>(acked.size());
  for (int64_t t = from_ns; t <= from_ns + span_ns; t += kMs) {
    std::vector<std::pair<uint32_t, PathSample>> samples;
    for (uint32_t i = 0; i < acked.size(); ++i) {
      acked[i] += static_cast<uint64_t>(share * 1e-3);
      samples.emplace_back(i, delivering(acked[i], share));
    }
    meter.observe(samples, t);
  }
}

void sums_the_connections() {
  DeliveryMeter meter;
  std::vector<uint64_t> acked(4, 0);
  busy_stretch(meter, acked, 100e6, 0, 1000 * kMs);
  CHECK(near(meter.seconds(), 1.0, 0.01));
  CHECK(near(meter.bytes() / meter.seconds(), 100e6, 1e-6));
}

void streaming_waits_do_not_count() {
  // Ten 30 ms bursts at 50 MB/s, each followed by 120 ms in which the sender waits on its
  // producer: the connections report application-limited samples, then nothing.
  DeliveryMeter meter;
  std::vector<uint64_t> acked(2, 0);
  int64_t t = 0;
  for (int burst = 0; burst < 10; ++burst) {
    busy_stretch(meter, acked, 50e6, t, 30 * kMs);
    t += 31 * kMs;
    meter.observe({{0, delivering(acked[0], 1e6, true)}, {1, delivering(acked[1], 1e6, true)}}, t);
    t += 120 * kMs;
  }
  CHECK(near(meter.seconds(), 0.30, 0.05));
  CHECK(near(meter.bytes() / meter.seconds(), 50e6, 0.02));
}

void idle_connection_is_left_out() {
  // Connection 1's last sample is unflagged but old: its acked count stands still.
  DeliveryMeter meter;
  for (int64_t t = 0; t <= 500 * kMs; t += kMs) {
    const auto acked = static_cast<uint64_t>(t / kMs) * 30'000;
    meter.observe({{0, delivering(acked, 30e6)}, {1, delivering(12345, 80e6)}}, t);
  }
  CHECK(near(meter.bytes() / meter.seconds(), 30e6, 1e-6));
}

void application_limited_samples_say_nothing() {
  DeliveryMeter meter;
  for (int64_t t = 0; t <= 200 * kMs; t += kMs)
    meter.observe({{0, delivering(static_cast<uint64_t>(t / kMs) * 1000, 1e6, true)}}, t);
  CHECK(meter.seconds() == 0 && meter.bytes() == 0);
}

void reconnect_is_a_new_baseline() {
  DeliveryMeter meter;
  std::vector<uint64_t> acked(1, 5'000'000);
  busy_stretch(meter, acked, 10e6, 0, 100 * kMs);
  const double seconds = meter.seconds();
  const double bytes = meter.bytes();
  // The stream reconnected: its count restarts at 0; that reading is no delivery.
  meter.observe({{0, delivering(1000, 10e6)}}, 101 * kMs);
  meter.observe({{0, delivering(1000, 10e6)}}, 400 * kMs);  // and 299 ms without progress
  CHECK(meter.seconds() == seconds && meter.bytes() == bytes);
  // Counting resumes from the new baseline, once the stream delivers again.
  meter.observe({{0, delivering(11'000, 10e6)}}, 401 * kMs);
  meter.observe({{0, delivering(21'000, 10e6)}}, 402 * kMs);
  CHECK(meter.bytes() == bytes + 10'000);
}

void counts_acknowledged_bytes_not_rate_samples() {
  // Four connections sharing 2.5 GB/s on a busy CPU deliver in turns: each ack's burst
  // samples 12 GB/s. What the link carried is what the acknowledged counters grew by.
  DeliveryMeter meter;
  std::vector<uint64_t> acked(4, 0);
  for (int64_t t = 0; t <= 100 * kMs; t += kMs) {
    std::vector<std::pair<uint32_t, PathSample>> samples;
    for (uint32_t i = 0; i < acked.size(); ++i) {
      acked[i] += 625'000;
      samples.emplace_back(i, delivering(acked[i], 12e9));
    }
    meter.observe(samples, t);
  }
  // The first reading is each connection's baseline; the step to the second is not known
  // to be path-limited yet.
  CHECK(meter.bytes() == 99 * 4 * 625'000.0);
  CHECK(near(meter.bytes() / meter.seconds(), 2.5e9, 1e-9));
}

void acks_in_bunches_count_the_time_between() {
  // 10 MB/s, looked at every millisecond, acks arriving every 5 ms with 5 ms of bytes (an
  // ack-compressing path): the gaps between bunches are the link's time too.
  DeliveryMeter meter;
  uint64_t acked = 0;
  for (int64_t t = 0; t <= 500 * kMs; t += kMs) {
    if (t % (5 * kMs) == 0) acked += 50'000;
    meter.observe({{0, delivering(acked, 10e6)}}, t);
  }
  CHECK(near(meter.bytes() / meter.seconds(), 10e6, 1e-9));
}

void a_stall_while_data_is_outstanding_counts() {
  // 10 MB/s, then a loss: 200 ms (5 RTTs) without a cumulative ack and no look, data
  // outstanding all along; the repair acknowledges those 2 MB at once.
  DeliveryMeter meter;
  std::vector<uint64_t> acked(1, 0);
  busy_stretch(meter, acked, 10e6, 0, 100 * kMs);
  PathSample last = delivering(acked[0], 10e6);
  last.data_outstanding = true;
  meter.observe({{0, last}}, 101 * kMs);
  const double seconds = meter.seconds(), bytes = meter.bytes();
  acked[0] += 2'000'000;
  meter.observe({{0, delivering(acked[0], 10e6)}}, 301 * kMs);
  CHECK(near(meter.seconds(), seconds + 0.201, 1e-9) && meter.bytes() == bytes + 2'000'000);  // with the look at 101 ms
}

void the_time_after_the_last_delivery_does_not_count() {
  // A transfer ends; the next look, 60 ms later, finds nothing more acknowledged.
  DeliveryMeter meter;
  std::vector<uint64_t> acked(2, 0);
  busy_stretch(meter, acked, 10e6, 0, 50 * kMs);
  const double seconds = meter.seconds(), bytes = meter.bytes();
  meter.observe({{0, delivering(acked[0], 10e6)}, {1, delivering(acked[1], 10e6)}}, 110 * kMs);
  CHECK(meter.seconds() == seconds && meter.bytes() == bytes);
}

void late_reading_is_dropped_and_silence_says_nothing() {
  DeliveryMeter meter;
  std::vector<uint64_t> acked(1, 0);
  busy_stretch(meter, acked, 10e6, 0, 10 * kMs);
  const double seconds = meter.seconds(), bytes = meter.bytes();
  meter.observe({{0, delivering(0, 99e9)}}, 5 * kMs);  // older than what it saw: ignored
  CHECK(meter.seconds() == seconds);
  // The last reading was path-limited, the next comes 5 s later with the transfer's last
  // acks: when in those 5 s they arrived is unknown, so neither counts.
  acked[0] += 1000;
  meter.observe({{0, delivering(acked[0], 10e6)}}, 5010 * kMs);
  CHECK(meter.seconds() == seconds && meter.bytes() == bytes);
  // Readings a round trip apart count again (srtt 40 ms here).
  acked[0] += 400'000;
  meter.observe({{0, delivering(acked[0], 10e6)}}, 5050 * kMs);
  CHECK(near(meter.seconds(), seconds + 0.04, 1e-9) && meter.bytes() == bytes + 400'000);
}

}  // namespace

int main(int argc, char** argv) {
  return run_case_main(argc, argv,
                       {{"sums_the_connections", sums_the_connections},
                        {"streaming_waits_do_not_count", streaming_waits_do_not_count},
                        {"idle_connection_is_left_out", idle_connection_is_left_out},
                        {"application_limited_samples_say_nothing", application_limited_samples_say_nothing},
                        {"reconnect_is_a_new_baseline", reconnect_is_a_new_baseline},
                        {"counts_acknowledged_bytes_not_rate_samples", counts_acknowledged_bytes_not_rate_samples},
                        {"acks_in_bunches_count_the_time_between", acks_in_bunches_count_the_time_between},
                        {"a_stall_while_data_is_outstanding_counts", a_stall_while_data_is_outstanding_counts},
                        {"the_time_after_the_last_delivery_does_not_count",
                         the_time_after_the_last_delivery_does_not_count},
                        {"late_reading_is_dropped_and_silence_says_nothing", late_reading_is_dropped_and_silence_says_nothing}});
}
