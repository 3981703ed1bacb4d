// The verbs emulator's wire: every opened device listens on a loopback TCP port (its LID);
// a QP in RTS runs a requester thread that dials the LID of its RTR address vector, sends
// its write WRs (a header, then the payload read from registered memory), retransmits
// them after a reconnect and fails them past their ACK timeout; each accepted connection
// runs a responder thread that checks a write (QP, PSN, receive, rkey) and places its
// payload into registered memory, then ACKs or NAKs it.
#pragma once

#include <mutex>

#include "objects.h"

namespace pddcore::rdma::emulator {

// Starts the thread that accepts wire connections on c.listener, one responder each.
void start_responders(Context& c);

// Stops accepting, closes every wire connection and joins the responders.
void stop_responders(Context& c);

// Starts q's requester (the QP has just entered RTS).
void start_requester(Qp& q);

// Joins q's requester, if it runs; `lock` holds q.mutex and is released meanwhile.
void stop_requester(Qp& q, std::unique_lock<std::mutex>& lock);

// Tells q's requester that its send queue changed.
void wake(const Qp& q);

}  // namespace pddcore::rdma::emulator
