// StreamRule (streams="auto") against paths worked out by hand.
// Built and run by tests/test_transfer_streams.py; `stream_choice_test <case>`, exit 0 on success.
#include "transport/tcp/stream_choice.h"

#include <cmath>
#include <limits>

#include "check.h"

using pddcore::transfer::tcp::StreamRule;

namespace {

constexpr uint64_t kWmem = 4ull << 20;  // Linux's default tcp_wmem ceiling

StreamRule::Path path(double rate_bps, double rtt_s, double loss = 0, bool loss_based = false) {
  StreamRule::Path p;
  p.rate_Bps = rate_bps / 8;
  p.min_rtt_s = rtt_s;
  p.loss = loss;
  p.send_buffer_bytes = kWmem;
  p.loss_based = loss_based;
  return p;
}

void unmeasured_path_gets_the_initial_count() {
  CHECK(StreamRule::for_path(path(0, 0.05)) == StreamRule::kInitial);
  CHECK(StreamRule::for_path(path(1e9, 0)) == StreamRule::kInitial);
  StreamRule::Path no_buffer = path(1e9, 0.05);
  no_buffer.send_buffer_bytes = 0;
  CHECK(StreamRule::for_path(no_buffer) == StreamRule::kInitial);
}

void short_path_keeps_the_initial_count() {
  // Loopback: 25 Gbit/s at 30 us holds 94 KB in flight.
  CHECK(StreamRule::for_path(path(25e9, 30e-6)) == StreamRule::kInitial);
  // One datacenter: 10 Gbit/s at 200 us, 250 KB.
  CHECK(StreamRule::for_path(path(10e9, 200e-6)) == StreamRule::kInitial);
}

void bandwidth_delay_product_sets_the_count() {
  // 1 Gbit/s at 50 ms: 6.25 MB in flight, twice that over 2 MiB of payload per connection.
  CHECK(StreamRule::for_path(path(1e9, 0.05)) == 6);
  // 1.6 Gbit/s at 50 ms, 10 MB: 9.5 -> 10.
  CHECK(StreamRule::for_path(path(1.6e9, 0.05)) == 10);
  // A bigger send buffer holds more: 32 MiB each, the initial 4 suffice.
  StreamRule::Path big = path(1.6e9, 0.05);
  big.send_buffer_bytes = 32ull << 20;
  CHECK(StreamRule::for_path(big) == StreamRule::kInitial);
}

void window_limited_connections_ask_for_more() {
  // 4 connections each holding 2 MiB of payload on a 50 ms path deliver 4 x 2 MiB / 50 ms
  // whatever the path's capacity: the rule asks for twice as many.
  const double window_limited_bps = 4 * (2 << 20) * 8 / 0.05;
  CHECK(StreamRule::for_path(path(window_limited_bps, 0.05)) == 8);
}

void long_fat_path_is_capped() {
  CHECK(StreamRule::for_path(path(10e9, 0.05)) == StreamRule::kMax);
  CHECK(StreamRule::for_path(path(std::numeric_limits<double>::infinity(), 0.05)) == StreamRule::kMax);
}

void loss_asks_for_more_cubic_connections_only() {
  // 200 Mbit/s at 50 ms: 1.25 MB in flight, the initial 4 by the first rule. At 0.1 % loss a
  // cubic connection holds about 1.22 / sqrt(0.001) = 38.6 segments, 55.9 KB: 22 would be
  // needed, capped at 16; at 0.001 % about 386 segments, 559 KB: 3 -> still the initial 4.
  CHECK(StreamRule::for_path(path(200e6, 0.05, 0.001, true)) == StreamRule::kMax);
  CHECK(StreamRule::for_path(path(200e6, 0.05, 0.00001, true)) == StreamRule::kInitial);
  // 40 Mbit/s at 50 ms, 1 % loss: 250 KB over 12.2 segments (17.7 KB): 14.2 -> 15.
  CHECK(StreamRule::for_path(path(40e6, 0.05, 0.01, true)) == 15);
  // bbr does not back off on loss: the same paths keep the count the first rule gives.
  CHECK(StreamRule::for_path(path(200e6, 0.05, 0.001, false)) == StreamRule::kInitial);
  CHECK(StreamRule::for_path(path(40e6, 0.05, 0.01, false)) == StreamRule::kInitial);
}

}  // namespace

int main(int argc, char** argv) {
  return run_case_main(argc, argv,
                       {{"unmeasured_path_gets_the_initial_count", unmeasured_path_gets_the_initial_count},
                        {"short_path_keeps_the_initial_count", short_path_keeps_the_initial_count},
                        {"bandwidth_delay_product_sets_the_count", bandwidth_delay_product_sets_the_count},
                        {"window_limited_connections_ask_for_more", window_limited_connections_ask_for_more},
                        {"long_fat_path_is_capped", long_fat_path_is_capped},
                        {"loss_asks_for_more_cubic_connections_only", loss_asks_for_more_cubic_connections_only}});
}
