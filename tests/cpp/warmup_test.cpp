// WarmupJudge (warming fresh data connections on long paths) against hand-made readings.
// Built and run by tests/test_transfer_warmup.py; `warmup_test <case>`, exit 0 on success.
#include "transport/tcp/warmup.h"

#include <cmath>

#include "check.h"

using pddcore::transfer::PathSample;
using pddcore::transfer::tcp::WarmupJudge;

namespace {

constexpr int64_t kMs = 1'000'000;
constexpr double kRtt = 0.050;

PathSample reading(double rate_Bps, bool past_slow_start = false) {
  PathSample s{kRtt, kRtt, 0};
  s.delivery_rate_Bps = rate_Bps;
  s.delivery_app_limited = false;
  s.past_slow_start = past_slow_start;
  return s;
}

// Feeds one reading per millisecond, the rate given per round trip by `rate_of(round)`;
// returns the round in which the judge said warm (-1: never within `rounds`).
template <typename F>
int rounds_until_warm(WarmupJudge& judge, F rate_of, int rounds) {
  for (int64_t t = 1; t <= rounds * 50 * kMs; t += kMs)
    if (judge.warm(reading(rate_of(static_cast<int>(t / (50 * kMs)))), t, 0)) return static_cast<int>(t / (50 * kMs));
  return -1;
}

void only_long_paths_are_warmed() {
  CHECK(!WarmupJudge::worth_warming(0.00003));  // loopback
  CHECK(!WarmupJudge::worth_warming(0.002));    // one datacenter
  CHECK(WarmupJudge::worth_warming(0.005) && WarmupJudge::worth_warming(0.050));
}

void a_growing_rate_keeps_warming() {
  // Doubling every round trip (slow start): never judged warm within 20 rounds.
  WarmupJudge judge(false);
  CHECK(rounds_until_warm(judge, [](int r) { return 1e5 * (1 << r); }, 20) == -1);
}

void a_flat_rate_ends_it_after_three_rounds() {
  // Doubling for 8 round trips, then flat at the path's rate: warm three rounds later.
  WarmupJudge judge(false);
  const int warm = rounds_until_warm(judge, [](int r) { return 1e5 * (1 << (r < 8 ? r : 8)); }, 30);
  CHECK(warm >= 10 && warm <= 12);
}

void slow_start_end_ends_it_for_cubic_only() {
  WarmupJudge cubic(true), bbr(false);
  CHECK(cubic.warm(reading(1e6, true), kMs, 0));
  CHECK(!bbr.warm(reading(1e6, true), kMs, 0));  // after a switch to bbr the flag means nothing
}

void caps_end_it() {
  WarmupJudge by_bytes(false);
  CHECK(by_bytes.warm(reading(1e6), kMs, WarmupJudge::kMaxBytes));
  WarmupJudge by_rounds(false);  // still growing by 30 % per round trip: stops at the cap
  const int warm = rounds_until_warm(by_rounds, [](int r) { return 1e5 * std::pow(1.3, r); }, 60);
  CHECK(warm == WarmupJudge::kMaxRounds);
}

}  // namespace

int main(int argc, char** argv) {
  return run_case_main(argc, argv,
                       {{"only_long_paths_are_warmed", only_long_paths_are_warmed},
                        {"a_growing_rate_keeps_warming", a_growing_rate_keeps_warming},
                        {"a_flat_rate_ends_it_after_three_rounds", a_flat_rate_ends_it_after_three_rounds},
                        {"slow_start_end_ends_it_for_cubic_only", slow_start_end_ends_it_for_cubic_only},
                        {"caps_end_it", caps_end_it}});
}
