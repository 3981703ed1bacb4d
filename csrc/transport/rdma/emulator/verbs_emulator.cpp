// The verbs emulator's verbs: the entry points of its VerbsTable. Each checks its
// arguments as libibverbs and the RC hardware do (errno or a returned error code), then
// creates, changes or destroys the objects (objects.h), moves QPs through their state
// machine (qp_state.h) and starts or stops their wire threads (wire.h).
#include "verbs_emulator.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <memory>
#include <random>
#include <string>

#include "objects.h"
#include "qp_state.h"
#include "wire.h"

namespace pddcore::rdma::emulator {
namespace {

ibv_device* emulated_device() {
  static ibv_device device = [] {
    ibv_device d{};
    d.node_type = IBV_NODE_CA;
    d.transport_type = IBV_TRANSPORT_IB;
    std::snprintf(d.name, sizeof(d.name), "verbs-emulator0");
    std::snprintf(d.dev_name, sizeof(d.dev_name), "verbs-emulator0");
    return d;
  }();
  return &device;
}

ibv_device** get_device_list(int* num_devices) {
  auto** list = new ibv_device*[2]{emulated_device(), nullptr};
  if (num_devices != nullptr) *num_devices = 1;
  return list;
}

void free_device_list(ibv_device** list) { delete[] list; }

const char* get_device_name(ibv_device* device) { return device->name; }

ibv_context* open_device(ibv_device* device) {
  if (device != emulated_device()) {
    errno = ENODEV;
    return nullptr;
  }
  auto* c = new Context();
  try {
    c->listener = transfer::listen_tcp({"127.0.0.1", 0}, &c->port);
  } catch (const std::exception&) {
    delete c;
    errno = EIO;
    return nullptr;
  }
  std::random_device rd;
  c->next_key = rd() & 0xFFFF00u;
  c->next_qpn = (rd() & 0x7FFF0u) + 0x100;
  c->handle.owner = c;
  c->handle.verbs.device = device;
  c->handle.verbs.cmd_fd = -1;
  c->handle.verbs.async_fd = -1;
  c->handle.verbs.num_comp_vectors = 1;
  start_responders(*c);
  g_counters.contexts++;
  return &c->handle.verbs;
}

int close_device(ibv_context* context) {
  Context* c = owner_of<Context>(context);
  {
    std::lock_guard<std::mutex> lock(c->mutex);
    if (c->children != 0 || !c->mrs.empty() || !c->qps.empty()) return EBUSY;
  }
  stop_responders(*c);
  delete c;
  g_counters.contexts--;
  return 0;
}

int query_port(ibv_context* context, uint8_t port_num, ibv_port_attr* attr) {
  if (port_num != 1) return EINVAL;
  *attr = ibv_port_attr{};
  attr->state = IBV_PORT_ACTIVE;
  attr->max_mtu = IBV_MTU_4096;
  attr->active_mtu = IBV_MTU_4096;
  attr->gid_tbl_len = 1;
  attr->max_msg_sz = static_cast<uint32_t>(kMaxMessage);
  attr->pkey_tbl_len = 1;
  attr->lid = owner_of<Context>(context)->port;  // the wire's loopback port
  attr->link_layer = IBV_LINK_LAYER_INFINIBAND;
  attr->phys_state = 5;  // LinkUp
  return 0;
}

int query_gid(ibv_context*, uint8_t port_num, int index, ibv_gid* gid) {
  if (port_num != 1 || index != 0) return EINVAL;
  *gid = ibv_gid{};
  gid->raw[10] = gid->raw[11] = 0xFF;  // ::ffff:127.0.0.1, IPv4-mapped as RoCEv2 GIDs are
  gid->raw[12] = 127;
  gid->raw[15] = 1;
  return 0;
}

ibv_pd* alloc_pd(ibv_context* context) {
  Context* c = owner_of<Context>(context);
  auto* pd = new Pd();
  pd->handle.owner = pd;
  pd->context = c;
  pd->handle.verbs.context = context;
  std::lock_guard<std::mutex> lock(c->mutex);
  pd->handle.verbs.handle = c->next_key++;
  c->children++;
  g_counters.pds++;
  return &pd->handle.verbs;
}

int dealloc_pd(ibv_pd* handle) {
  Pd* pd = owner_of<Pd>(handle);
  Context* c = pd->context;
  {
    std::lock_guard<std::mutex> lock(c->mutex);
    if (pd->users != 0) return EBUSY;
    c->children--;
  }
  delete pd;
  g_counters.pds--;
  return 0;
}

ibv_mr* reg_mr(ibv_pd* handle, void* addr, size_t length, int access) {
  Pd* pd = owner_of<Pd>(handle);
  Context* c = pd->context;
  // As in verbs: remote write needs local write; unknown flags and null ranges are refused.
  if ((access & ~kAccessKnown) || ((access & IBV_ACCESS_REMOTE_WRITE) && !(access & IBV_ACCESS_LOCAL_WRITE)) ||
      (addr == nullptr && length != 0)) {
    errno = EINVAL;
    return nullptr;
  }
  auto* mr = new Mr();
  mr->handle.owner = mr;
  mr->pd = pd;
  mr->access = access;
  ibv_mr& v = mr->handle.verbs;
  v.context = handle->context;
  v.pd = handle;
  v.addr = addr;
  v.length = length;
  std::unique_lock<std::shared_mutex> memory(c->memory);
  std::lock_guard<std::mutex> lock(c->mutex);
  const uint32_t index = c->next_key++ & 0xFFFFFFu;
  v.lkey = v.rkey = (index << 8) | ((index * 0x9Du) & 0xFF);
  v.handle = v.lkey;
  c->mrs[v.lkey] = mr;
  pd->users++;
  g_counters.mrs++;
  return &v;
}

int dereg_mr(ibv_mr* handle) {
  Mr* mr = owner_of<Mr>(handle);
  Context* c = mr->pd->context;
  {
    std::unique_lock<std::shared_mutex> memory(c->memory);
    std::lock_guard<std::mutex> lock(c->mutex);
    c->mrs.erase(handle->lkey);
    mr->pd->users--;
  }
  delete mr;
  g_counters.mrs--;
  return 0;
}

ibv_cq* create_cq(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel, int comp_vector) {
  if (cqe < 1 || cqe > kMaxCqe || comp_vector != 0) {
    errno = EINVAL;
    return nullptr;
  }
  if (channel != nullptr) {  // completion channels are not emulated: the backend polls
    errno = EOPNOTSUPP;
    return nullptr;
  }
  Context* c = owner_of<Context>(context);
  auto* cq = new Cq();
  cq->handle.owner = cq;
  cq->context = c;
  cq->capacity = static_cast<size_t>(cqe);
  ibv_cq& v = cq->handle.verbs;
  v.context = context;
  v.cq_context = cq_context;
  v.cqe = cqe;
  std::lock_guard<std::mutex> lock(c->mutex);
  c->children++;
  g_counters.cqs++;
  return &v;
}

int destroy_cq(ibv_cq* handle) {
  Cq* cq = owner_of<Cq>(handle);
  {
    std::lock_guard<std::mutex> lock(cq->context->mutex);
    if (cq->users != 0) return EBUSY;
    cq->context->children--;
  }
  delete cq;
  g_counters.cqs--;
  return 0;
}

int poll_cq(ibv_cq* handle, int num_entries, ibv_wc* wc) {
  Cq* cq = owner_of<Cq>(handle);
  std::lock_guard<std::mutex> lock(cq->mutex);
  if (cq->overrun) return -EOVERFLOW;
  int n = 0;
  for (; n < num_entries && !cq->entries.empty(); ++n) {
    wc[n] = cq->entries.front();
    cq->entries.pop_front();
  }
  return n;
}

ibv_qp* create_qp(ibv_pd* pd_handle, ibv_qp_init_attr* attr) {
  Pd* pd = owner_of<Pd>(pd_handle);
  Context* c = pd->context;
  const ibv_qp_cap& cap = attr->cap;
  if (attr->qp_type != IBV_QPT_RC || attr->srq != nullptr) {
    errno = EOPNOTSUPP;  // the emulator models reliable-connected QPs only
    return nullptr;
  }
  if (attr->send_cq == nullptr || attr->recv_cq == nullptr || attr->send_cq->context != pd_handle->context ||
      attr->recv_cq->context != pd_handle->context || cap.max_send_wr == 0 || cap.max_send_wr > kMaxWr ||
      cap.max_recv_wr > kMaxWr || cap.max_send_sge > kMaxSge || cap.max_recv_sge > kMaxSge ||
      cap.max_inline_data > 0) {
    errno = EINVAL;
    return nullptr;
  }
  auto q = std::make_shared<Qp>();
  q->handle.owner = q.get();
  q->context = c;
  q->pd = pd;
  q->send_cq = owner_of<Cq>(attr->send_cq);
  q->recv_cq = owner_of<Cq>(attr->recv_cq);
  q->cap = cap;
  q->signal_all = attr->sq_sig_all != 0;
  q->wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  ibv_qp& v = q->handle.verbs;
  v.context = pd_handle->context;
  v.qp_context = attr->qp_context;
  v.pd = pd_handle;
  v.send_cq = attr->send_cq;
  v.recv_cq = attr->recv_cq;
  v.qp_type = IBV_QPT_RC;
  v.state = IBV_QPS_RESET;
  std::lock_guard<std::mutex> lock(c->mutex);
  v.qp_num = c->next_qpn++ & kPsnMask;
  v.handle = v.qp_num;
  c->qps[v.qp_num] = q;
  pd->users++;
  q->send_cq->users++;
  q->recv_cq->users++;
  g_counters.qps++;
  return &v;
}

int modify_qp(ibv_qp* handle, ibv_qp_attr* a, int mask) {
  Qp& q = *owner_of<Qp>(handle);
  std::unique_lock<std::mutex> lock(q.mutex);
  const ibv_qp_state from = q.state;
  const ibv_qp_state to = (mask & IBV_QP_STATE) ? a->qp_state : from;
  if (const int err = check_transition_locked(q, to, *a, mask)) return err;
  apply_attributes_locked(q, *a, mask);

  if (to == IBV_QPS_RESET) {
    stop_requester(q, lock);
    q.send_queue.clear();  // RESET discards work requests without completing them
    q.receive_queue.clear();
    q.access = 0;
  } else if (to == IBV_QPS_ERR) {
    if (from != IBV_QPS_ERR) enter_error_locked(q, std::string::npos, IBV_WC_WR_FLUSH_ERR);
  } else if (from == IBV_QPS_RTR && to == IBV_QPS_RTS) {
    start_requester(q);
  }
  q.state = to;
  handle->state = to;
  q.receive_posted.notify_all();
  return 0;
}

int destroy_qp(ibv_qp* handle) {
  Qp* raw = owner_of<Qp>(handle);
  Context* c = raw->context;
  raw->destroying = true;
  {
    std::unique_lock<std::mutex> lock(raw->mutex);
    raw->receive_posted.notify_all();
    stop_requester(*raw, lock);
  }
  std::shared_ptr<Qp> q;
  {
    std::lock_guard<std::mutex> lock(c->mutex);
    auto it = c->qps.find(handle->qp_num);
    q = it->second;
    c->qps.erase(it);
    q->pd->users--;
    q->send_cq->users--;
    q->recv_cq->users--;
  }
  {
    std::lock_guard<std::mutex> in_use(q->in_use);  // wait out a responder mid-packet
    q->destroyed = true;
  }
  ::close(q->wake_fd);
  q->wake_fd = -1;
  g_counters.qps--;
  return 0;
}

int post_send(ibv_qp* handle, ibv_send_wr* wr, ibv_send_wr** bad_wr) {
  Qp& q = *owner_of<Qp>(handle);
  std::lock_guard<std::mutex> lock(q.mutex);
  for (; wr != nullptr; wr = wr->next) {
    int err = 0;
    if (q.state != IBV_QPS_RTS && q.state != IBV_QPS_ERR) err = EINVAL;
    else if (wr->opcode != IBV_WR_RDMA_WRITE && wr->opcode != IBV_WR_RDMA_WRITE_WITH_IMM) err = EINVAL;
    else if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > q.cap.max_send_sge) err = EINVAL;
    else if (wr->send_flags & IBV_SEND_INLINE) err = EINVAL;
    else if (q.send_queue.size() >= q.cap.max_send_wr) err = ENOMEM;
    SendWqe w;
    w.length = 0;
    if (err == 0) {
      w.sge.assign(wr->sg_list, wr->sg_list + wr->num_sge);
      for (const ibv_sge& s : w.sge) w.length += s.length;
      if (w.length > kMaxMessage) err = EINVAL;
    }
    if (err != 0) {
      *bad_wr = wr;
      return err;
    }
    w.wr_id = wr->wr_id;
    w.with_imm = wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
    w.signaled = q.signal_all || (wr->send_flags & IBV_SEND_SIGNALED);
    w.imm = w.with_imm ? wr->imm_data : 0;
    w.remote_addr = wr->wr.rdma.remote_addr;
    w.rkey = wr->wr.rdma.rkey;
    if (q.state == IBV_QPS_ERR) {  // work posted to a QP in error completes flushed
      push_completion(q.send_cq, send_completion(q, w.wr_id, IBV_WC_WR_FLUSH_ERR));
      continue;
    }
    w.packets = std::max<uint32_t>(1, static_cast<uint32_t>((w.length + q.mtu_bytes - 1) / q.mtu_bytes));
    w.psn = q.next_psn;
    q.next_psn = (q.next_psn + w.packets) & kPsnMask;
    q.send_queue.push_back(std::move(w));
  }
  wake(q);
  return 0;
}

int post_recv(ibv_qp* handle, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  Qp& q = *owner_of<Qp>(handle);
  std::lock_guard<std::mutex> lock(q.mutex);
  for (; wr != nullptr; wr = wr->next) {
    int err = 0;
    if (q.state == IBV_QPS_RESET) err = EINVAL;
    else if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > q.cap.max_recv_sge) err = EINVAL;
    else if (q.receive_queue.size() >= q.cap.max_recv_wr) err = ENOMEM;
    if (err != 0) {
      *bad_wr = wr;
      return err;
    }
    if (q.state == IBV_QPS_ERR) {
      ibv_wc wc{};
      wc.wr_id = wr->wr_id;
      wc.status = IBV_WC_WR_FLUSH_ERR;
      wc.opcode = IBV_WC_RECV;
      wc.qp_num = handle->qp_num;
      push_completion(q.recv_cq, wc);
      continue;
    }
    q.receive_queue.push_back(wr->wr_id);
  }
  q.receive_posted.notify_all();
  return 0;
}

const char* wc_status_str(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_SUCCESS: return "success";
    case IBV_WC_LOC_LEN_ERR: return "local length error";
    case IBV_WC_LOC_QP_OP_ERR: return "local QP operation error";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR: return "Work Request Flushed Error";
    case IBV_WC_REM_INV_REQ_ERR: return "remote invalid request error";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error";
    case IBV_WC_REM_OP_ERR: return "remote operation error";
    case IBV_WC_RETRY_EXC_ERR: return "transport retry counter exceeded";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    default: return "unknown";
  }
}

}  // namespace

const VerbsTable& verbs() {
  static const VerbsTable table = [] {
    VerbsTable t{};
    t.provider = "verbs emulator";
    t.get_device_list = get_device_list;
    t.free_device_list = free_device_list;
    t.get_device_name = get_device_name;
    t.open_device = open_device;
    t.close_device = close_device;
    t.query_port = query_port;
    t.query_gid = query_gid;
    t.alloc_pd = alloc_pd;
    t.dealloc_pd = dealloc_pd;
    t.reg_mr = reg_mr;
    t.dereg_mr = dereg_mr;
    t.create_cq = create_cq;
    t.destroy_cq = destroy_cq;
    t.create_qp = create_qp;
    t.modify_qp = modify_qp;
    t.destroy_qp = destroy_qp;
    t.post_send = post_send;
    t.post_recv = post_recv;
    t.poll_cq = poll_cq;
    t.wc_status_str = wc_status_str;
    return t;
  }();
  return table;
}

Counters counters() {
  Counters c;
  c.contexts = g_counters.contexts;
  c.pds = g_counters.pds;
  c.mrs = g_counters.mrs;
  c.cqs = g_counters.cqs;
  c.qps = g_counters.qps;
  c.wire_connections = g_counters.connections;
  c.writes_placed = g_counters.writes_placed;
  c.bytes_placed = g_counters.bytes_placed;
  c.writes_rejected = g_counters.writes_rejected;
  return c;
}

}  // namespace pddcore::rdma::emulator

extern "C" __attribute__((visibility("default"))) const pddcore::rdma::VerbsTable* pddcore_verbs_emulator_table() {
  return &pddcore::rdma::emulator::verbs();
}
