// FenceTable: a fence is confirmed only once no chunk of its transfer is being written.
// Built and run by tests/test_transfer_security.py; `fence_table_test <case>`, exit 0 on success.
#include "transport/fence_table.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "check.h"

using pddcore::transfer::FenceTable;

namespace {

constexpr uint64_t kSender = 0xABCDEF;

// Nothing of the transfer being written: confirmed at once, and its chunks are dropped after.
void quiet_transfer_is_confirmed() {
  FenceTable fences;
  CHECK(fences.install(kSender, 5, 10.0));
  CHECK(!fences.begin(kSender, 5));
  CHECK(fences.begin(kSender, 6));       // another tag
  CHECK(fences.begin(kSender + 1, 5));   // the same tag from another sender
}

// A chunk begun before the fence and still being written when the wait ends: not confirmed;
// once it ends, a second install confirms.
void chunk_in_flight_past_the_timeout_is_not_confirmed() {
  FenceTable fences;
  CHECK(fences.begin(kSender, 9));
  CHECK(!fences.install(kSender, 9, 0.05));
  CHECK(!fences.begin(kSender, 9));  // fenced meanwhile all the same
  fences.end(kSender, 9);
  CHECK(fences.install(kSender, 9, 0.05));
}

// The chunk ends while install waits: install returns confirmed, and not before the end.
void install_waits_for_the_chunk_to_end() {
  FenceTable fences;
  CHECK(fences.begin(kSender, 3));
  std::atomic<bool> ended{false};
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ended = true;
    fences.end(kSender, 3);
  });
  CHECK(fences.install(kSender, 3, 30.0));
  CHECK(ended);
  writer.join();
}

// Closing the table ends the wait, unconfirmed while the chunk is still being written.
void close_ends_the_wait_unconfirmed() {
  FenceTable fences;
  CHECK(fences.begin(kSender, 4));
  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    fences.close();
  });
  CHECK(!fences.install(kSender, 4, 30.0));
  closer.join();
}

}  // namespace

int main(int argc, char** argv) {
  return run_case_main(argc, argv,
                       {{"quiet_transfer_is_confirmed", quiet_transfer_is_confirmed},
                        {"chunk_in_flight_past_the_timeout_is_not_confirmed",
                         chunk_in_flight_past_the_timeout_is_not_confirmed},
                        {"install_waits_for_the_chunk_to_end", install_waits_for_the_chunk_to_end},
                        {"close_ends_the_wait_unconfirmed", close_ends_the_wait_unconfirmed}});
}
