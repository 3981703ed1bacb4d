// congestion_control="auto"'s rule and its loss count against hand-made readings.
// Built and run by tests/test_transfer_congestion.py; `congestion_choice_test <case>`.
#include "transport/tcp/congestion_choice.h"

#include <cstring>

#include "check.h"

using pddcore::transfer::tcp::CongestionRule;
using pddcore::transfer::tcp::LossCount;

namespace {

constexpr double kShortRtt = 0.002;  // one datacenter, long enough for loss to count

// Feeds readings 100 segments apart, `lost_per_100` of each hundred retransmitted;
// `queued_every` > 0 makes every n-th reading show a standing queue. Returns the segments
// sent when the count said lossy, or 0 if it never did within `segments`.
uint64_t segments_until_lossy(LossCount& count, double min_rtt_s, uint64_t lost_per_100, uint64_t segments,
                              int queued_every = 0, bool past_slow_start = true) {
  uint64_t retransmits = 0;
  int reading = 0;
  for (uint64_t sent = 0; sent <= segments; sent += 100, retransmits += lost_per_100) {
    ++reading;
    const bool queued = queued_every > 0 && reading % queued_every == 0;
    const double srtt_s = queued ? 3 * min_rtt_s : 1.2 * min_rtt_s;
    if (count.observe(srtt_s, min_rtt_s, past_slow_start, sent, retransmits)) return sent;
  }
  return 0;
}

void the_handshake_rtt_picks_the_algorithm() {
  CHECK(std::strcmp(CongestionRule::after_handshake(0.00003), "cubic") == 0);  // loopback
  CHECK(std::strcmp(CongestionRule::after_handshake(0), "cubic") == 0);        // not measured
  CHECK(std::strcmp(CongestionRule::after_handshake(0.0049), "cubic") == 0);
  CHECK(std::strcmp(CongestionRule::after_handshake(0.005), "bbr") == 0);
  CHECK(std::strcmp(CongestionRule::after_handshake(0.050), "bbr") == 0);
}

void a_lossy_path_is_found_after_enough_segments() {
  LossCount count;
  // 3 % loss: the first reading only sets where counting starts, so 1000 segments are
  // counted at the reading of segment 1000.
  CHECK(segments_until_lossy(count, kShortRtt, 3, 100000) == 1000);
}

void light_loss_is_not_a_lossy_path() {
  LossCount count;
  CHECK(segments_until_lossy(count, kShortRtt, 0, 100000) == 0);
  LossCount light;  // 0.5 % of segments, under kLossyShare
  uint64_t retransmits = 0, found = 0;
  for (uint64_t sent = 0; sent <= 100000 && found == 0; sent += 200, retransmits += 1)
    if (light.observe(1.2 * kShortRtt, kShortRtt, true, sent, retransmits)) found = sent;
  CHECK(found == 0);
}

void drops_behind_a_standing_queue_are_not_counted() {
  LossCount count;  // every reading shows a queue: cubic's own drops
  CHECK(segments_until_lossy(count, kShortRtt, 10, 100000, 1) == 0);
}

void a_moments_queue_does_not_erase_the_count() {
  LossCount count;
  // Every third stretch ends behind a queue and is left out; the other two of each three
  // still add up: 1000 counted segments take 1500 sent. A count restarted at each queue
  // (200 segments at most) would never get there.
  CHECK(segments_until_lossy(count, kShortRtt, 3, 100000, 3) == 1500);
}

void slow_start_and_short_paths_are_not_counted() {
  LossCount in_slow_start;
  CHECK(segments_until_lossy(in_slow_start, kShortRtt, 10, 100000, 0, false) == 0);
  LossCount loopback;  // drops under kLossyPathMinRttS are the hosts' own
  CHECK(segments_until_lossy(loopback, 0.0003, 10, 100000) == 0);
}

}  // namespace

int main(int argc, char** argv) {
  return run_case_main(argc, argv,
                       {{"the_handshake_rtt_picks_the_algorithm", the_handshake_rtt_picks_the_algorithm},
                        {"a_lossy_path_is_found_after_enough_segments", a_lossy_path_is_found_after_enough_segments},
                        {"light_loss_is_not_a_lossy_path", light_loss_is_not_a_lossy_path},
                        {"drops_behind_a_standing_queue_are_not_counted", drops_behind_a_standing_queue_are_not_counted},
                        {"a_moments_queue_does_not_erase_the_count", a_moments_queue_does_not_erase_the_count},
                        {"slow_start_and_short_paths_are_not_counted", slow_start_and_short_paths_are_not_counted}});
}
