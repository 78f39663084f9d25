// r2comm's torch.distributed backend: a c10d::Backend (as ProcessGroupGloo and the UCC and
// oneCCL plugins are), built against the installed torch by r2comm/torch/native.py.
//
// The collectives of dense CPU tensors run here: a plan per call shape, fetched once from the
// communicator's Python planner (Channel.native_plan) and kept until its cell's generation
// moves; each call then takes a sequence number from the cell (r2_capi.h) and posts to the
// engine through its C-level interface, the GIL released, and returns a Work. A call goes
// through Python only where the cell says so (a plan switch being agreed or due, epoch checks:
// Channel.native_cross) and for what this file leaves to r2comm/torch/pyops.py: CUDA tensors
// (r2comm's device pipeline), sparse tensors, bitwise ops, uneven all-to-all, list-form
// all-to-all, gather, scatter, point to point, and any argument this file does not accept (so
// the errors are pyops' own: R2commArgumentError and friends).
//
// Completion: Work.wait() waits for its operation (GIL released) and raises its error, an
// instance of r2comm's class that is torch's DistBackendError (or DistNetworkError) as well,
// made by r2comm.torch.pyops.engine_error. A Work's future is set by the group's completion
// thread through a pool of delivery threads, which run the future's callbacks (a callback may
// start a collective and wait for it: PowerSGD).
// (ATen and torch's pybind11 casters, not <torch/extension.h>: the rest of torch's C++
// API costs a third more compile time and is not used here)
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <ATen/record_function.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "r2_capi.h"

namespace r2t __attribute__((visibility("hidden"))) {
namespace py = pybind11;

constexpr int kU8 = 4;             // r2comm/ops.py DTYPES
constexpr int64_t kNonblocking = 8;  // r2comm/plans.py NONBLOCKING
constexpr int kSum = 0, kProd = 1, kMin = 2, kMax = 3;
constexpr int kWork = 0, kSend = 1, kScratch = 2;
constexpr int64_t kSmall = 64 * 1024;  // bytes: an all_reduce this small uses a copy of its input

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kChar: return 0;
    case at::kShort: return 1;
    case at::kInt: return 2;
    case at::kLong: return 3;
    case at::kByte: return 4;
    case at::kUInt16: return 5;
    case at::kUInt32: return 6;
    case at::kUInt64: return 7;
    case at::kHalf: return 8;
    case at::kFloat: return 9;
    case at::kDouble: return 10;
    default: return -1;
  }
}

// ---------------------------------------------------------------------------------------------
// Errors: a Python exception instance (r2comm's class, torch's as well) carried through C++.

// Python is there to take references back (not finalizing): else they are left behind
bool py_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// Drop Python references held in C++ (GIL taken), or leave them where Python is going away
void drop(py::object& o) {
  if (!o) return;
  if (py_alive()) {
    py::gil_scoped_acquire g;
    o = py::object();
  } else {
    o.release();
  }
}

struct PyRef {  // a strong reference, dropped with the GIL
  PyObject* p = nullptr;
  explicit PyRef(PyObject* o) : p(o) {}
  ~PyRef() {
    if (p && py_alive()) {
      py::gil_scoped_acquire g;
      Py_DECREF(p);
    }
  }
};

class R2Error : public std::runtime_error {
 public:
  R2Error(const std::string& what, std::shared_ptr<PyRef> inst)
      : std::runtime_error(what), inst_(std::move(inst)) {}
  PyObject* instance() const { return inst_ ? inst_->p : nullptr; }

 private:
  std::shared_ptr<PyRef> inst_;
};

py::object& errors_fn() {  // r2comm.torch.pyops.engine_error (set at init)
  static py::object* fn = new py::object();
  return *fn;
}

// An engine error (code, message) as an exception_ptr: r2comm's exception made by Python, or a
// DistBackendError where Python cannot be asked.
std::exception_ptr engine_error(int code, const std::string& msg) {
  if (py_alive()) {
    py::gil_scoped_acquire g;
    try {
      py::object inst = errors_fn()(code, msg);
      std::string text = py::str(inst);
      PyObject* raw = inst.release().ptr();
      return std::make_exception_ptr(R2Error(text, std::make_shared<PyRef>(raw)));
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("r2comm: making an engine error");
    }
  }
  return std::make_exception_ptr(c10::DistBackendError(
      {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, "r2comm: " + msg));
}

// The current Python error (GIL held) as an exception_ptr of R2Error, or the error itself
std::exception_ptr python_error(py::error_already_set& e) {
  std::string text = e.what();
  PyObject* v = e.value().ptr();
  Py_XINCREF(v);
  return std::make_exception_ptr(R2Error(text, std::make_shared<PyRef>(v)));
}

// ---------------------------------------------------------------------------------------------
// Delivery threads: set futures where no completion waits on them (their callbacks run there).

class Deliverer {
 public:
  void put(std::function<void()> fn) {
    bool spawn;
    {
      std::lock_guard<std::mutex> g(mu_);
      q_.push_back(std::move(fn));
      ++pending_;
      spawn = pending_ > idle_;
    }
    cv_.notify_one();
    if (spawn) std::thread([this] { run(); }).detach();
  }

 private:
  void run() {
    std::unique_lock<std::mutex> g(mu_);
    for (;;) {
      ++idle_;
      bool got = cv_.wait_for(g, std::chrono::seconds(30), [this] { return !q_.empty(); });
      --idle_;
      if (!got) {
        if (pending_ <= idle_) return;
        continue;
      }
      auto fn = std::move(q_.front());
      q_.pop_front();
      --pending_;
      g.unlock();
      try {
        fn();
      } catch (...) {  // a callback's error belongs to its future
      }
      g.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  int idle_ = 0, pending_ = 0;
};

Deliverer& deliverer() {
  static Deliverer* d = new Deliverer();  // never destroyed: its threads may outlive main
  return *d;
}

// ---------------------------------------------------------------------------------------------
// The engine and a communicator as this file holds them

struct Engine {
  const r2_capi* api = nullptr;
  void* h = nullptr;
  ~Engine() {
    if (h) api->engine_unref(h);
  }
};

struct Copy {  // a local copy of a schedule: (dst buffer, offset, src buffer, offset, bytes)
  int db;
  uint64_t doff;
  int sb;
  uint64_t soff;
  uint64_t n;
};

struct PlanEntry {
  PyObject* plan = nullptr;  // the Python Plan (its PlanC is used at post)
  void* planc = nullptr;
  uint32_t count = 0;
  int64_t desc = 0;
  uint64_t scratch = 0;
  std::vector<Copy> pre, post;
  bool fills_work = false;
  std::vector<int> members;
};

struct PlanKey {
  int coll;
  uint64_t nbytes;
  int itemsize, root, dtc, redop;
  bool separate;
  bool operator==(const PlanKey& o) const {
    return coll == o.coll && nbytes == o.nbytes && itemsize == o.itemsize && root == o.root &&
           dtc == o.dtc && redop == o.redop && separate == o.separate;
  }
};
struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    size_t h = std::hash<uint64_t>()(k.nbytes);
    h = h * 31 + static_cast<size_t>(k.coll);
    h = h * 31 + static_cast<size_t>(k.itemsize);
    h = h * 31 + static_cast<size_t>(k.root);
    h = h * 31 + static_cast<size_t>(k.dtc);
    h = h * 31 + static_cast<size_t>(k.redop);
    return h * 2 + (k.separate ? 1 : 0);
  }
};

const char* kCollNames[] = {"allreduce", "bcast", "reduce", "allgather", "reduce_scatter_block",
                            "alltoall", "barrier"};
enum Coll { ALLREDUCE, BCAST, REDUCE, ALLGATHER, REDUCE_SCATTER, ALLTOALL, BARRIER };

// One posted engine operation, as a Work waits for it
struct Posted {
  uint64_t oid = 0;
  double timeout = 0;
  std::vector<std::tuple<uint8_t*, const uint8_t*, uint64_t>> post;  // copies once it ended
};

class Channel {
 public:
  Channel(py::object comm, py::object gate, std::shared_ptr<Engine> eng)
      : comm_(std::move(comm)), gate_(std::move(gate)), eng_(std::move(eng)) {
    cell_obj_ = comm_.attr("cell");
    cell_ = eng_->api->cell(cell_obj_.ptr());
    if (!cell_) throw py::error_already_set();
  }
  ~Channel() {
    if (py_alive()) {
      py::gil_scoped_acquire g;
      clear_plans();
    }
    drop(comm_);
    drop(gate_);
    drop(cell_obj_);
  }

  r2_cell* cell() const { return cell_; }
  py::object& comm() { return comm_; }

  // Flags set: through Python first (a plan switch, an epoch check; closed raises). Registered
  // memory: false (the caller hands the whole call to pyops).
  bool cross() {
    uint32_t f = r2_cell_load(&cell_->flags);
    if (!f) return true;
    if (f & R2_CELL_REGMEM) return false;
    py::gil_scoped_acquire g;
    gate_.attr("native_cross")();
    return true;
  }

  // Post one collective; throws (an R2Error) where it cannot be posted.
  Posted post(Coll coll, uint8_t* work, const uint8_t* send, uint64_t nbytes, int itemsize,
              int root, int dtc, int redop, bool separate, const std::vector<Copy>& extra_pre,
              std::vector<uint8_t>* scratch_out) {
    PlanEntry* pe = plan({coll, nbytes, itemsize, root, dtc, redop, separate});
    uint8_t* scratch = nullptr;
    if (pe->scratch) {
      scratch_out->resize(pe->scratch);
      scratch = scratch_out->data();
    }
    uint64_t ptr[3] = {reinterpret_cast<uint64_t>(work), reinterpret_cast<uint64_t>(send),
                       reinterpret_cast<uint64_t>(scratch)};
    auto apply = [&](const Copy& c) {
      if (c.n) std::memcpy(reinterpret_cast<void*>(ptr[c.db] + c.doff),
                           reinterpret_cast<const void*>(ptr[c.sb] + c.soff), c.n);
    };
    if (!pe->fills_work)
      for (const auto& c : extra_pre) apply(c);
    for (const auto& c : pe->pre) apply(c);
    Posted p;
    p.timeout = r2_cell_timeout(cell_);
    uint32_t seq = r2_cell_take(cell_);
    p.oid = eng_->api->post(eng_->h, pe->planc, ptr, dtc, redop, cell_->comm, seq, pe->count,
                            p.timeout, pe->members.data(), static_cast<int>(pe->members.size()),
                            0, pe->desc | kNonblocking, 0);
    if (p.oid == 0) std::rethrow_exception(engine_error(6, "the communicator's engine is closed"));
    for (const auto& c : pe->post)
      p.post.emplace_back(reinterpret_cast<uint8_t*>(ptr[c.db] + c.doff),
                          reinterpret_cast<const uint8_t*>(ptr[c.sb] + c.soff), c.n);
    return p;
  }

  // Wait for a posted operation (bounded by its timeout, or `limit` s if smaller), release it;
  // nullptr or its error
  std::exception_ptr wait(Posted& p, double limit) {
    const r2_capi* api = eng_->api;
    int err = 0;
    uint64_t nrecv = 0;
    char msg[512];
    double t = limit >= 0 && limit < p.timeout ? limit : p.timeout;
    int state = api->wait(eng_->h, p.oid, t, &err, msg, sizeof msg, &nrecv);
    if (state == R2_ACTIVE) {
      char why[96];
      std::snprintf(why, sizeof why, "operation timed out after %g s", t);
      api->cancel(eng_->h, p.oid, 1, why);
      state = api->wait(eng_->h, p.oid, 5.0, &err, msg, sizeof msg, &nrecv);
      if (state == R2_ACTIVE) return engine_error(1, why);
    }
    if (state == R2_GONE) return engine_error(6, "communicator has been freed");
    api->release(eng_->h, p.oid);
    if (state == R2_ERROR) return engine_error(err, msg);
    for (auto& c : p.post)
      if (std::get<2>(c)) std::memcpy(std::get<0>(c), std::get<1>(c), std::get<2>(c));
    return nullptr;
  }

  // End a running operation with R2commClosedError (code 6) here and on its peers
  void cancel(const Posted& p, const char* why) {
    eng_->api->cancel(eng_->h, p.oid, 6, why);
  }

  // Done without waiting? (a test: nothing released)
  bool ended(const Posted& p) {
    int err = 0;
    uint64_t nrecv = 0;
    char msg[8];
    return eng_->api->wait(eng_->h, p.oid, 0.0, &err, msg, sizeof msg, &nrecv) != R2_ACTIVE;
  }

 private:
  PlanEntry* plan(const PlanKey& k) {
    uint32_t gen = r2_cell_load(&cell_->gen);
    {
      std::lock_guard<std::mutex> g(mu_);
      if (gen == gen_) {
        auto it = plans_.find(k);
        if (it != plans_.end()) return it->second.get();
      }
    }
    py::gil_scoped_acquire g;
    py::tuple t = gate_.attr("native_plan")(kCollNames[k.coll], k.nbytes, k.itemsize, k.root,
                                            k.dtc, k.redop, k.separate);
    auto pe = std::make_unique<PlanEntry>();
    py::object planobj = t[0];
    pe->planc = eng_->api->plan(planobj.ptr());
    if (!pe->planc) throw py::error_already_set();
    pe->plan = planobj.inc_ref().ptr();
    pe->count = t[1].cast<uint32_t>();
    pe->desc = t[2].cast<int64_t>();
    pe->scratch = t[3].cast<uint64_t>();
    for (int which = 4; which <= 5; ++which)
      for (auto c : t[which].cast<py::list>()) {
        auto ct = c.cast<py::tuple>();
        (which == 4 ? pe->pre : pe->post)
            .push_back({ct[0].cast<int>(), ct[1].cast<uint64_t>(), ct[2].cast<int>(),
                        ct[3].cast<uint64_t>(), ct[4].cast<uint64_t>()});
      }
    pe->fills_work = t[6].cast<bool>();
    pe->members = t[7].cast<std::vector<int>>();
    uint32_t pgen = t[8].cast<uint32_t>();
    std::lock_guard<std::mutex> lk(mu_);
    if (pgen != gen_ || plans_.size() > 256) {
      clear_plans_locked();
      gen_ = pgen;
    }
    PlanEntry* raw = pe.get();
    auto old = plans_.find(k);
    if (old != plans_.end()) {
      Py_XDECREF(old->second->plan);
      plans_.erase(old);
    }
    plans_.emplace(k, std::move(pe));
    return raw;
  }

  void clear_plans() {  // GIL held
    std::lock_guard<std::mutex> g(mu_);
    clear_plans_locked();
  }
  void clear_plans_locked() {  // GIL and mu_ held
    for (auto& kv : plans_) Py_XDECREF(kv.second->plan);
    plans_.clear();
  }

  py::object comm_, gate_, cell_obj_;   // gate_: pyops.Ops (native_cross, native_plan)
  std::shared_ptr<Engine> eng_;
  r2_cell* cell_ = nullptr;
  std::mutex mu_;
  uint32_t gen_ = 0xFFFFFFFFu;
  std::unordered_map<PlanKey, std::unique_ptr<PlanEntry>, PlanKeyHash> plans_;
};

// ---------------------------------------------------------------------------------------------
// Works

class R2Work : public c10d::Work {
 public:
  R2Work(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
         const std::optional<std::vector<at::Tensor>>& inputs)
      : c10d::Work(rank, type, title, inputs), outputs_(std::move(outputs)) {}

  // Wait for the operation (at most `limit` s; < 0: its own timeout) and finish the work;
  // idempotent, thread safe
  void complete(double limit) {
    std::lock_guard<std::mutex> g(run_mu_);
    complete_locked(limit);
  }

  // Ended without blocking? then completed (never waits for another thread's completion)
  bool poll() {
    if (done_.load(std::memory_order_acquire)) return true;
    std::unique_lock<std::mutex> g(run_mu_, std::try_to_lock);
    if (!g.owns_lock()) return false;
    bool ready;
    try {
      ready = ready_now();
    } catch (...) {
      ready = true;
    }
    if (ready) complete_locked(-1);
    return done_.load(std::memory_order_acquire);
  }

  // Stop the operation with an error now (the group's abort), then complete it
  void abort_now() {
    std::lock_guard<std::mutex> g(run_mu_);
    if (done_.load(std::memory_order_acquire)) return;
    try {
      cancel();
    } catch (...) {
    }
    complete_locked(-1);
  }

 private:
  void complete_locked(double limit) {
    if (done_.load(std::memory_order_acquire)) return;
    std::exception_ptr err;
    try {
      err = run(limit);
    } catch (...) {
      err = std::current_exception();
    }
    error_ = err;
    done_.store(true, std::memory_order_release);
    finish(err);  // c10d::Work: completed_, exception_, the profiler's end, waiters
    // (the future is not set here: this may be the group's completion thread, and a future's
    // callbacks may start a collective and wait for it; deliver() hands it to a delivery
    // thread, wait() and getFuture() set it in the caller's thread)
  }

 public:
  bool done() const { return done_.load(std::memory_order_acquire); }

  bool isCompleted() override { return poll(); }
  bool isSuccess() const override { return done() && !error_; }
  std::exception_ptr exception() const override { return error_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  void synchronize() override {}

  bool wait(std::chrono::milliseconds timeout) override {
    if (!done()) {
      double limit = timeout.count() <= 0 ? -1.0 : timeout.count() / 1000.0;
      complete(limit);
    }
    settle();
    if (error_) std::rethrow_exception(error_);
    return true;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    bool queue_it = false;
    {
      std::lock_guard<std::mutex> g(fut_mu_);
      if (!future_) {
        future_ = c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()));
        queue_it = true;
      }
    }
    if (done()) {
      settle();
    } else if (queue_it && on_future_) {
      on_future_(this);  // the group's completion thread completes it, then delivers
    }
    return future_;
  }

  // set by the backend: hand this work to its completion thread
  std::function<void(R2Work*)> on_future_;
  int source_rank_ = -1;
  int sourceRank() const override {
    TORCH_CHECK(source_rank_ >= 0, "r2comm: only a completed receive from any source has a "
                                   "source rank");
    return source_rank_;
  }

  // Settle the future through the deliverer (the completion thread calls this)
  void deliver() {
    c10::intrusive_ptr<c10::ivalue::Future> f;
    {
      std::lock_guard<std::mutex> g(fut_mu_);
      if (!future_ || settled_) return;
      settled_ = true;
      f = future_;
    }
    auto err = error_;
    auto outs = outputs_;
    deliverer().put([f, err, outs] {
      if (err)
        f->setError(err);
      else
        f->markCompleted(c10::IValue(outs));
    });
  }

 protected:
  virtual std::exception_ptr run(double limit) = 0;  // wait and finish (run_mu_ held)
  virtual bool ready_now() = 0;                       // ended? (never blocks)
  virtual void cancel() {}                            // end it with an error (abort)

  std::vector<at::Tensor> outputs_;
  std::exception_ptr error_;

 private:
  void settle() {  // set the future here (a waiter's thread) if asked for and not yet
    c10::intrusive_ptr<c10::ivalue::Future> f;
    {
      std::lock_guard<std::mutex> g(fut_mu_);
      if (!future_ || settled_ || !done()) return;
      settled_ = true;
      f = future_;
    }
    if (error_)
      f->setError(error_);
    else
      f->markCompleted(c10::IValue(outputs_));
  }
  std::mutex run_mu_, fut_mu_;
  std::atomic<bool> done_{false};
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool settled_ = false;
};

// Engine operations of one channel, then a finishing step (copies back, AVG's division)
class NativeWork : public R2Work {
 public:
  using R2Work::R2Work;
  std::shared_ptr<Channel> chan;
  std::vector<Posted> ops;
  std::vector<at::Tensor> keep;          // inputs and staging, alive until the end
  std::vector<std::vector<uint8_t>> scratch;
  std::function<void()> finish_fn;       // on success, after the operations
  std::exception_ptr preset;             // an error known at the call

 protected:
  std::exception_ptr run(double limit) override {
    std::exception_ptr first = preset;
    for (auto& p : ops) {
      auto e = chan->wait(p, limit);
      if (e && !first) first = e;
    }
    ops.clear();
    if (!first && finish_fn) {
      at::NoGradGuard ng;
      finish_fn();
    }
    finish_fn = nullptr;
    keep.clear();
    scratch.clear();
    return first;
  }
  bool ready_now() override {
    for (auto& p : ops)
      if (!chan->ended(p)) return false;
    return true;
  }
  void cancel() override {
    for (auto& p : ops) chan->cancel(p, "the group was aborted");
  }
};

// An operation of r2comm/torch/pyops.py (its handle: wait(timeout), test(), source_rank())
class PyWork : public R2Work {
 public:
  PyWork(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
         py::object handle)
      : R2Work(rank, type, title, std::move(outputs), std::nullopt),
        handle_(new PyRef(handle.release().ptr())) {}

 protected:
  std::exception_ptr run(double limit) override {
    py::gil_scoped_acquire g;
    try {
      py::handle h(handle_->p);
      if (limit >= 0)
        h.attr("wait")(limit);
      else
        h.attr("wait")(py::none());
      int src = h.attr("source_rank")().cast<int>();
      if (src >= 0) source_rank_ = src;
    } catch (py::error_already_set& e) {
      return python_error(e);
    }
    return nullptr;
  }
  bool ready_now() override {
    py::gil_scoped_acquire g;
    try {
      return py::handle(handle_->p).attr("test")().cast<bool>();
    } catch (py::error_already_set&) {
      return true;
    }
  }
  void cancel() override {
    py::gil_scoped_acquire g;
    try {
      py::handle(handle_->p).attr("abort")();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("r2comm: aborting an operation");
    }
  }

 private:
  std::unique_ptr<PyRef> handle_;
};

// Several works as one (coalesced calls, list forms): done when all are, the first error
class JoinWork : public R2Work {
 public:
  JoinWork(int rank, std::vector<c10::intrusive_ptr<R2Work>> parts, std::vector<at::Tensor> outs)
      : R2Work(rank, c10d::OpType::COALESCED, nullptr, std::move(outs), std::nullopt),
        parts_(std::move(parts)) {}

 protected:
  std::exception_ptr run(double limit) override {
    std::exception_ptr first;
    for (auto& w : parts_) {
      w->complete(limit);
      auto e = w->exception();
      if (e && !first) first = e;
    }
    return first;
  }
  bool ready_now() override {
    for (auto& w : parts_)
      if (!w->poll()) return false;
    return true;
  }

 private:
  std::vector<c10::intrusive_ptr<R2Work>> parts_;
};

// ---------------------------------------------------------------------------------------------
// The completion thread of a group: completes the works whose future was asked for, in order

class Completer {
 public:
  Completer() : th_([this] { loop(); }) {}
  ~Completer() { stop(); }
  void put(c10::intrusive_ptr<R2Work> w) {
    {
      std::lock_guard<std::mutex> g(mu_);
      q_.push_back(std::move(w));
    }
    cv_.notify_one();
  }
  void stop() {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_one();
    if (th_.joinable()) {
      if (th_.get_id() == std::this_thread::get_id())
        th_.detach();
      else
        th_.join();
    }
  }

 private:
  void loop() {
    for (;;) {
      c10::intrusive_ptr<R2Work> w;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [this] { return stopping_ || !q_.empty(); });
        if (q_.empty()) return;
        w = std::move(q_.front());
        q_.pop_front();
      }
      w->complete(-1);
      w->deliver();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<R2Work>> q_;
  bool stopping_ = false;
  std::thread th_;
};

// ---------------------------------------------------------------------------------------------
// A tensor as the engine sees it: contiguous host memory of the reduction dtype (or bytes),
// with the copy back into the tensor where it was staged

struct Host {
  at::Tensor tensor;  // the caller's
  at::Tensor host;    // contiguous, on the CPU: what the engine reads and writes
  at::Tensor flat;    // host as the engine's dtype (reduce) or bytes
  bool copy = false;  // host is a copy: written back into tensor
  int dtc = kU8;

  uint8_t* data() const { return static_cast<uint8_t*>(flat.data_ptr()); }
  uint64_t nbytes() const { return flat.nbytes(); }
  void writeback() const {
    if (!copy) return;
    at::Tensor dst = tensor.is_complex() ? at::view_as_real(tensor) : tensor;
    dst.copy_(host.view(dst.sizes()));
  }
};

// Whether this file can take tensor t (else pyops does, and raises what it refuses)
bool native_ok(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided) return false;
  if (t.numel() == 0) return true;
  if (!t.has_storage()) return false;
  // every element inside its storage (a storage resized under its tensor holds fewer)
  int64_t last = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) < 0) return false;
    last += (t.size(d) - 1) * t.stride(d);
  }
  return static_cast<uint64_t>((last + 1) * t.element_size()) <= t.storage().nbytes();
}

Host host_of(const at::Tensor& t, bool reduce, bool out) {
  Host h;
  h.tensor = t;
  at::Tensor x = t;
  bool copy = false;
  if (x.is_neg() || x.is_conj()) {
    x = x.resolve_conj().resolve_neg();
    copy = true;
  }
  if (!x.is_contiguous()) {
    x = x.contiguous();
    copy = true;
  }
  if (x.is_complex()) x = at::view_as_real(x);
  x = x.reshape({-1});
  if (reduce) {
    if (x.scalar_type() == at::kBFloat16) {
      x = x.to(at::kFloat);  // reduced in float32, rounded back once
      copy = true;
    } else if (x.scalar_type() == at::kBool) {
      x = x.view(at::kByte);
    }
    h.dtc = dtype_code(x.scalar_type());
    h.flat = x;
  } else {
    h.flat = x.view(at::kByte);
  }
  h.host = x;
  h.copy = copy && out;
  return h;
}

// (engine op, divide by the group size) of a torch reduce op on a dtype; engine op -1: not
// here (pyops: bitwise ops of integers, PREMUL_SUM, dtypes or pairs it refuses)
std::pair<int, bool> redop_of(const c10d::ReduceOp& rop, at::ScalarType dt) {
  auto k = rop.op_;
  if (dt == at::kBool) {
    switch (k) {
      case c10d::ReduceOp::SUM: case c10d::ReduceOp::MAX: case c10d::ReduceOp::BOR:
        return {kMax, false};
      case c10d::ReduceOp::PRODUCT: case c10d::ReduceOp::MIN: case c10d::ReduceOp::BAND:
        return {kMin, false};
      default: return {-1, false};
    }
  }
  bool cplx = at::isComplexType(dt);
  at::ScalarType base = cplx ? c10::toRealValueType(dt) : dt;
  if (base != at::kBFloat16 && dtype_code(base) < 0) return {-1, false};
  switch (k) {
    case c10d::ReduceOp::SUM: return {kSum, false};
    case c10d::ReduceOp::AVG:
      if (!at::isFloatingType(base)) return {-1, false};
      return {kSum, true};
    case c10d::ReduceOp::PRODUCT: return cplx ? std::make_pair(-1, false) : std::make_pair(kProd, false);
    case c10d::ReduceOp::MIN: return cplx ? std::make_pair(-1, false) : std::make_pair(kMin, false);
    case c10d::ReduceOp::MAX: return cplx ? std::make_pair(-1, false) : std::make_pair(kMax, false);
    default: return {-1, false};
  }
}

// ---------------------------------------------------------------------------------------------
// The backend

class R2commBackend : public c10d::Backend {
 public:
  R2commBackend(int rank, int size, py::object comm, py::object ops, py::object engine,
                py::object capsule)
      : c10d::Backend(rank, size), ops_(std::move(ops)) {
    auto* api = static_cast<const r2_capi*>(PyCapsule_GetPointer(capsule.ptr(), R2_CAPI_NAME));
    if (!api) throw py::error_already_set();
    TORCH_CHECK(api->version == R2_CAPI_VERSION && api->size >= static_cast<int>(sizeof(r2_capi)),
                "r2comm: the engine's C interface is version ", api->version,
                "; this backend was built for ", R2_CAPI_VERSION, " (rebuild it)");
    auto eng = std::make_shared<Engine>();
    eng->api = api;
    eng->h = api->engine_ref(engine.ptr());
    if (!eng->h) throw py::error_already_set();
    chan_ = std::make_shared<Channel>(std::move(comm), ops_, eng);
    completer_ = std::make_shared<Completer>();
  }

  ~R2commBackend() override {
    completer_->stop();
    drop(ops_);
    chan_.reset();
  }

  const std::string getBackendName() const override { return "r2comm"; }
  bool supportsCoalescing() const override { return true; }
  bool supportsShrinking() const override { return true; }

  void setTimeout(std::chrono::milliseconds timeout) override {
    r2_cell_set_timeout(chan_->cell(), timeout.count() / 1000.0);
  }
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return issued_.load(); }

  py::object comm() { return chan_->comm(); }
  py::object ops() { return ops_; }
  size_t pending() {
    std::lock_guard<std::mutex> g(mu_);
    return inflight_.size();
  }

  // -- collectives -----------------------------------------------------------------------------
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    if (tensors.size() == 1 && native_ok(tensors[0]) && !tensors[0].is_sparse()) {
      at::Tensor& t = tensors[0];
      auto [op, avg] = redop_of(opts.reduceOp, t.scalar_type());
      if (op >= 0 && chan_->cross()) {
        if (!opts.asyncOp && !at::hasCallbacks()) {
          auto quick = small_sync_allreduce(tensors, op, avg);
          if (quick) return quick;
        }
        auto w = make_native(c10d::OpType::ALLREDUCE, "r2comm:all_reduce", tensors, tensors);
        Host h = host_of(t, true, true);
        if (h.nbytes()) {
          if (static_cast<int64_t>(h.nbytes()) <= kSmall) {
            // a copy of the input as the send buffer: the plan without local copies
            w->scratch.emplace_back(h.data(), h.data() + h.nbytes());
            const uint8_t* send = w->scratch.back().data();
            auto& tmp = scratch_tmp(w);
            w->ops.push_back(chan_->post(ALLREDUCE, h.data(), send, h.nbytes(),
                                         h.flat.element_size(), 0, h.dtc, op, true, {}, &tmp));
          } else {
            w->ops.push_back(chan_->post(ALLREDUCE, h.data(), h.data(), h.nbytes(),
                                         h.flat.element_size(), 0, h.dtc, op, false, {},
                                         &scratch_tmp(w)));
          }
          int n = getSize();
          w->keep.push_back(h.host);
          w->finish_fn = [h, avg, n] {
            if (avg) h.host.div_(n);
            h.writeback();
          };
        }
        return issue(w, opts.asyncOp);
      }
    }
    return py_call("allreduce", c10d::OpType::ALLREDUCE, tensors,
                   [&] { return py::make_tuple(tensors, reduce_kind(opts.reduceOp)); });
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    std::vector<c10::intrusive_ptr<R2Work>> parts;
    c10d::AllreduceOptions one;
    one.reduceOp = opts.reduceOp;
    one.asyncOp = true;
    for (auto& t : tensors) {
      std::vector<at::Tensor> v{t};
      parts.push_back(c10::static_intrusive_pointer_cast<R2Work>(allreduce(v, one)));
    }
    return join(std::move(parts), tensors, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    if (tensors.size() == 1 && opts.rootTensor == 0 && native_ok(tensors[0]) &&
        root_ok(opts.rootRank) && chan_->cross()) {
      auto w = make_native(c10d::OpType::BROADCAST, "r2comm:broadcast", tensors, tensors);
      Host h = host_of(tensors[0], false, getRank() != opts.rootRank);
      if (h.nbytes()) {
        w->ops.push_back(chan_->post(BCAST, h.data(), nullptr, h.nbytes(), 1,
                                     static_cast<int>(opts.rootRank), kU8, 0, false, {},
                                     &scratch_tmp(w)));
        w->keep.push_back(h.host);
        w->finish_fn = [h] { h.writeback(); };
      }
      return issue(w, opts.asyncOp);
    }
    return py_call("broadcast", c10d::OpType::BROADCAST, tensors,
                   [&] { return py::make_tuple(tensors, opts.rootRank, opts.rootTensor); });
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    if (tensors.size() == 1 && opts.rootTensor == 0 && native_ok(tensors[0]) &&
        !tensors[0].is_sparse() && root_ok(opts.rootRank)) {
      auto [op, avg] = redop_of(opts.reduceOp, tensors[0].scalar_type());
      if (op >= 0 && chan_->cross()) {
        bool mine = getRank() == opts.rootRank;
        auto w = make_native(c10d::OpType::REDUCE, "r2comm:reduce", tensors, tensors);
        Host h = host_of(tensors[0], true, mine);
        if (h.nbytes()) {
          w->ops.push_back(chan_->post(REDUCE, mine ? h.data() : nullptr, h.data(), h.nbytes(),
                                       h.flat.element_size(), static_cast<int>(opts.rootRank),
                                       h.dtc, op, !mine, {}, &scratch_tmp(w)));
          int n = getSize();
          w->keep.push_back(h.host);
          if (mine)
            w->finish_fn = [h, avg, n] {
              if (avg) h.host.div_(n);
              h.writeback();
            };
        }
        return issue(w, opts.asyncOp);
      }
    }
    return py_call("reduce", c10d::OpType::REDUCE, tensors,
                   [&] { return py::make_tuple(tensors, reduce_kind(opts.reduceOp), opts.rootRank,
                                  opts.rootTensor); });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    int n = getSize();
    if (inputs.size() == 1 && outputs.size() == 1 && static_cast<int>(outputs[0].size()) == n &&
        native_ok(inputs[0]) && all_like(outputs[0], inputs[0]) && chan_->cross()) {
      auto& outs = outputs[0];
      auto w = make_native(c10d::OpType::ALLGATHER, "r2comm:all_gather", outs, inputs);
      Host s = host_of(inputs[0], false, false);
      uint64_t block = s.nbytes();
      if (block) {
        at::Tensor flat = at::empty({static_cast<int64_t>(block) * n}, at::kByte);
        auto* r = static_cast<uint8_t*>(flat.data_ptr());
        std::vector<Copy> pre{{kWork, static_cast<uint64_t>(getRank()) * block, kSend, 0, block}};
        w->ops.push_back(chan_->post(ALLGATHER, r, s.data(), block, 1, 0, kU8, 0, true, pre,
                                     &scratch_tmp(w)));
        w->keep.push_back(s.host);
        w->keep.push_back(flat);
        w->finish_fn = [outs, flat, n] {
          auto blocks = flat.view({n, -1});
          for (int i = 0; i < n; ++i) copy_bytes(outs[i], blocks[i]);
        };
      }
      return issue(w, opts.asyncOp);
    }
    return py_call("allgather", c10d::OpType::ALLGATHER, flat_list(outputs),
                   [&] { return py::make_tuple(outputs, inputs); });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    int n = getSize();
    if (native_ok(output) && native_ok(input) && output.scalar_type() == input.scalar_type() &&
        output.numel() == n * input.numel() && chan_->cross()) {
      std::vector<at::Tensor> outs{output}, ins{input};
      auto w = make_native(c10d::OpType::_ALLGATHER_BASE, "r2comm:_allgather_base", outs, ins);
      Host s = host_of(input, false, false), o = host_of(output, false, true);
      uint64_t block = s.nbytes();
      if (block) {
        uint8_t* r = o.data();
        std::vector<Copy> pre;
        bool in_place = s.data() == r + static_cast<uint64_t>(getRank()) * block;
        if (!in_place && overlap(s.data(), block, r, block * n)) {
          // the input lies in the output, but not at this rank's block: a copy of its own
          at::Tensor c = s.host.clone();
          s = host_of(c, false, false);
        }
        if (!in_place)
          pre.push_back({kWork, static_cast<uint64_t>(getRank()) * block, kSend, 0, block});
        w->ops.push_back(chan_->post(ALLGATHER, r, in_place ? nullptr : s.data(), block, 1, 0,
                                     kU8, 0, !in_place, pre, &scratch_tmp(w)));
        w->keep.push_back(s.host);
        w->keep.push_back(o.host);
        w->finish_fn = [o] { o.writeback(); };
      }
      return issue(w, opts.asyncOp);
    }
    std::vector<at::Tensor> outs{output};
    return py_call("all_gather_single", c10d::OpType::_ALLGATHER_BASE, outs,
                   [&] { return py::make_tuple(output, input); });
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "r2comm backend: as many outputs as inputs");
    std::vector<c10::intrusive_ptr<R2Work>> parts;
    c10d::AllgatherOptions one;
    for (size_t i = 0; i < inputs.size(); ++i)
      parts.push_back(c10::static_intrusive_pointer_cast<R2Work>(
          _allgather_base(outputs[i], inputs[i], one)));
    return join(std::move(parts), outputs, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    return py_call("allgather_coalesced", c10d::OpType::ALLGATHER_COALESCED, flat_list(outputs),
                   [&] { return py::make_tuple(outputs, inputs); });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    int n = getSize();
    if (outputs.size() == 1 && inputs.size() == 1 && static_cast<int>(inputs[0].size()) == n &&
        native_ok(outputs[0]) && all_like(inputs[0], outputs[0]) &&
        redop_of(opts.reduceOp, outputs[0].scalar_type()).first >= 0) {
      std::vector<at::Tensor> flat;
      for (auto& t : inputs[0]) flat.push_back(t.reshape({-1}));
      at::Tensor cat = at::cat(flat);
      return reduce_scatter_flat(outputs[0], cat, opts, c10d::OpType::REDUCE_SCATTER,
                                 "r2comm:reduce_scatter");
    }
    return py_call("reduce_scatter", c10d::OpType::REDUCE_SCATTER, outputs,
                   [&] { return py::make_tuple(outputs, inputs, reduce_kind(opts.reduceOp)); });
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    int n = getSize();
    if (native_ok(output) && native_ok(input) && input.scalar_type() == output.scalar_type() &&
        input.numel() == n * output.numel() &&
        redop_of(opts.reduceOp, output.scalar_type()).first >= 0)
      return reduce_scatter_flat(output, input, opts, c10d::OpType::_REDUCE_SCATTER_BASE,
                                 "r2comm:_reduce_scatter_base");
    std::vector<at::Tensor> outs{output};
    return py_call("reduce_scatter_single", c10d::OpType::_REDUCE_SCATTER_BASE, outs,
                   [&] { return py::make_tuple(output, input, reduce_kind(opts.reduceOp)); });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    TORCH_CHECK_VALUE(outputs.size() == inputs.size(), "r2comm backend: as many outputs as inputs");
    std::vector<c10::intrusive_ptr<R2Work>> parts;
    c10d::ReduceScatterOptions one;
    one.reduceOp = opts.reduceOp;
    for (size_t i = 0; i < inputs.size(); ++i)
      parts.push_back(c10::static_intrusive_pointer_cast<R2Work>(
          _reduce_scatter_base(outputs[i], inputs[i], one)));
    return join(std::move(parts), outputs, opts.asyncOp);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override {
    int n = getSize();
    int64_t rows = input.dim() ? input.size(0) : 1;
    if (output_splits.empty() && input_splits.empty() && native_ok(output) && native_ok(input) &&
        output.scalar_type() == input.scalar_type() && output.numel() == input.numel() &&
        rows % n == 0 && chan_->cross()) {
      std::vector<at::Tensor> outs{output}, ins{input};
      auto w = make_native(c10d::OpType::ALLTOALL_BASE, "r2comm:all_to_all", outs, ins);
      Host s = host_of(input, false, false), o = host_of(output, false, true);
      if (s.nbytes()) {
        if (overlap(s.data(), s.nbytes(), o.data(), o.nbytes())) {
          at::Tensor c = s.host.clone();
          s = host_of(c, false, false);
        }
        w->ops.push_back(chan_->post(ALLTOALL, o.data(), s.data(), s.nbytes() / n, 1, 0, kU8, 0,
                                     true, {}, &scratch_tmp(w)));
        w->keep.push_back(s.host);
        w->keep.push_back(o.host);
        w->finish_fn = [o] { o.writeback(); };
      }
      return issue(w, opts.asyncOp);
    }
    std::vector<at::Tensor> outs{output};
    return py_call("all_to_all_single", c10d::OpType::ALLTOALL_BASE, outs,
                   [&] { return py::make_tuple(output, input, output_splits, input_splits); });
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    return py_call("alltoall", c10d::OpType::ALLTOALL, outputs, [&] { return py::make_tuple(outputs, inputs); });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    if (chan_->cross()) {
      std::vector<at::Tensor> none;
      auto w = make_native(c10d::OpType::BARRIER, "r2comm:barrier", none, none);
      if (getSize() > 1)
        w->ops.push_back(chan_->post(BARRIER, nullptr, nullptr, 0, 1, 0, kU8, 0, false, {},
                                     &scratch_tmp(w)));
      return issue(w, opts.asyncOp);
    }
    std::vector<at::Tensor> none;
    return py_call("barrier", c10d::OpType::BARRIER, none, [&] { return py::make_tuple(); });
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    return py_call("gather", c10d::OpType::GATHER, flat_list(outputs),
                   [&] { return py::make_tuple(outputs, inputs, opts.rootRank); });
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    return py_call("scatter", c10d::OpType::SCATTER, outputs,
                   [&] { return py::make_tuple(outputs, inputs, opts.rootRank); });
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst,
                                      int tag) override {
    return py_call("send", c10d::OpType::SEND, tensors, [&] { return py::make_tuple(tensors, dst, tag); });
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src,
                                      int tag) override {
    return py_call("recv", c10d::OpType::RECV, tensors, [&] { return py::make_tuple(tensors, src, tag); });
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override {
    return py_call("recv_anysource", c10d::OpType::RECVANYSOURCE, tensors,
                   [&] { return py::make_tuple(tensors, tag); });
  }

  // -- coalescing, life ------------------------------------------------------------------------
  void startCoalescing() override {
    std::lock_guard<std::mutex> g(mu_);
    coalescing_ = true;
    coalesced_.clear();
  }

  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    std::vector<c10::intrusive_ptr<R2Work>> parts;
    {
      std::lock_guard<std::mutex> g(mu_);
      coalescing_ = false;
      parts.swap(coalesced_);
    }
    std::vector<at::Tensor> none;
    return join(std::move(parts), none, true);
  }

  void waitForPendingWorks() override {
    std::vector<c10::intrusive_ptr<R2Work>> all;
    {
      std::lock_guard<std::mutex> g(mu_);
      all.assign(inflight_.begin(), inflight_.end());
    }
    for (auto& w : all) w->complete(-1);
    sweep(true);
  }

  void shutdown() override {
    waitForPendingWorks();
    completer_->stop();
    py::gil_scoped_acquire g;
    ops_.attr("shutdown")();
  }

  void abort() override {
    // every operation in flight ends with an error now, here and (ABORTs) on its peers
    {
      py::gil_scoped_acquire g;
      try {
        ops_.attr("abort")();
      } catch (py::error_already_set& e) {
        e.discard_as_unraisable("r2comm: abort");
      }
    }
    std::vector<c10::intrusive_ptr<R2Work>> all;
    {
      std::lock_guard<std::mutex> g(mu_);
      all.assign(inflight_.begin(), inflight_.end());
    }
    for (auto& w : all) w->abort_now();
    sweep(true);
  }

  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranks_to_exclude,
                                           int shrink_flags,
                                           const c10::intrusive_ptr<Options>& opts) override {
    py::gil_scoped_acquire g;
    py::object made = ops_.attr("shrink")(ranks_to_exclude, shrink_flags);
    return made.cast<c10::intrusive_ptr<c10d::Backend>>();
  }

 private:
  bool root_ok(int64_t root) const { return root >= 0 && root < getSize(); }

  static bool all_like(const std::vector<at::Tensor>& ts, const at::Tensor& like) {
    for (auto& t : ts)
      if (!native_ok(t) || t.scalar_type() != like.scalar_type() || t.numel() != like.numel())
        return false;
    return true;
  }

  static bool overlap(const uint8_t* a, uint64_t na, const uint8_t* b, uint64_t nb) {
    return a < b + nb && b < a + na;
  }

  static void copy_bytes(const at::Tensor& t, const at::Tensor& block) {
    at::Tensor src = block.view(t.scalar_type() == at::kBool ? at::kByte : t.scalar_type());
    if (t.scalar_type() == at::kBool) src = src.view(at::kBool);
    at::Tensor dst = t;
    dst.copy_(t.dim() ? src.view(t.sizes()) : src.reshape({}));
  }

  static std::vector<at::Tensor> flat_list(const std::vector<std::vector<at::Tensor>>& ls) {
    std::vector<at::Tensor> out;
    for (auto& l : ls) out.insert(out.end(), l.begin(), l.end());
    return out;
  }

  static int reduce_kind(const c10d::ReduceOp& rop) { return static_cast<int>(rop.op_); }

  std::vector<uint8_t>& scratch_tmp(c10::intrusive_ptr<NativeWork>& w) {
    w->scratch.emplace_back();
    return w->scratch.back();
  }

  c10::intrusive_ptr<NativeWork> make_native(c10d::OpType type, const char* title,
                                             const std::vector<at::Tensor>& outs,
                                             const std::vector<at::Tensor>& ins) {
    bool prof = at::hasCallbacks();
    auto w = c10::make_intrusive<NativeWork>(getRank(), type, prof ? title : nullptr, outs,
                                             prof ? std::optional<std::vector<at::Tensor>>(ins)
                                                  : std::nullopt);
    w->chan = chan_;
    w->keep.insert(w->keep.end(), ins.begin(), ins.end());
    w->keep.insert(w->keep.end(), outs.begin(), outs.end());
    return w;
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_flat(at::Tensor& output, const at::Tensor& input,
                                                     const c10d::ReduceScatterOptions& opts,
                                                     c10d::OpType type, const char* title) {
    auto [op, avg] = redop_of(opts.reduceOp, output.scalar_type());
    if (!chan_->cross()) {
      std::vector<at::Tensor> outs{output};
      return py_call("reduce_scatter_single", type, outs,
                     [&] { return py::make_tuple(output, input, reduce_kind(opts.reduceOp)); });
    }
    std::vector<at::Tensor> outs{output}, ins{input};
    auto w = make_native(type, title, outs, ins);
    Host s = host_of(input, true, false);
    Host o = host_of(output, true, true);
    uint64_t block = o.nbytes();
    if (block) {
      if (overlap(s.data(), s.nbytes(), o.data(), block)) {
        // the output lies in the input (torch's in-place form): a block of its own
        at::Tensor c = at::empty_like(o.host);
        Host own = host_of(c, true, true);
        own.tensor = o.tensor;
        own.copy = true;
        o = own;
        o.host = c;
      }
      w->ops.push_back(chan_->post(REDUCE_SCATTER, o.data(), s.data(), block,
                                   o.flat.element_size(), 0, o.dtc, op, true, {},
                                   &scratch_tmp(w)));
      int n = getSize();
      w->keep.push_back(s.host);
      w->keep.push_back(o.host);
      w->finish_fn = [o, avg, n] {
        if (avg) o.host.div_(n);
        o.writeback();
      };
    }
    return issue(w, opts.asyncOp);
  }

  // A synchronous all_reduce of a small, contiguous tensor the engine reduces as it is (no
  // staging, no copy back): posted and waited for here, with a copy of the input as the send
  // buffer; nullptr where the tensor is not such a one (the general path takes it)
  c10::intrusive_ptr<c10d::Work> small_sync_allreduce(std::vector<at::Tensor>& tensors, int op,
                                                      bool avg) {
    at::Tensor& t = tensors[0];
    if (!t.is_contiguous() || t.is_neg() || t.is_conj() || t.is_complex()) return {};
    int dtc = dtype_code(t.scalar_type());
    uint64_t nb = t.nbytes();
    if (dtc < 0 || nb == 0 || nb > static_cast<uint64_t>(kSmall)) return {};
    auto w = c10::make_intrusive<NativeWork>(getRank(), c10d::OpType::ALLREDUCE, nullptr,
                                             tensors, std::nullopt);
    w->chan = chan_;
    w->keep.push_back(t);
    auto* p = static_cast<uint8_t*>(t.data_ptr());
    w->scratch.emplace_back(p, p + nb);        // the send buffer: the input as it was
    const uint8_t* send = w->scratch.back().data();
    w->ops.push_back(chan_->post(ALLREDUCE, p, send, nb, static_cast<int>(t.element_size()), 0,
                                 dtc, op, true, {}, &scratch_tmp(w)));
    if (avg) {
      int n = getSize();
      w->finish_fn = [t, n] { t.div_(n); };
    }
    return issue(w, false);
  }

  // A posted work: counted, held until it ended, completed now where torch waits at once
  c10::intrusive_ptr<c10d::Work> issue(c10::intrusive_ptr<NativeWork> w, bool async) {
    issued_.fetch_add(1);
    c10::intrusive_ptr<R2Work> r = w;
    if (!async) {
      r->complete(-1);  // torch waits on it at once: no hand-over
      note(r);
      return r;
    }
    return hold(r);
  }

  c10::intrusive_ptr<c10d::Work> hold(c10::intrusive_ptr<R2Work> r) {
    auto c = completer_;
    r->on_future_ = [c](R2Work* x) { c->put(c10::intrusive_ptr<R2Work>::reclaim_copy(x)); };
    bool sweep_now;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!r->done()) inflight_.push_back(r);
      sweep_now = inflight_.size() >= sweep_at_;
      if (coalescing_) coalesced_.push_back(r);
    }
    if (sweep_now) sweep(false);
    return r;
  }

  void note(const c10::intrusive_ptr<R2Work>& r) {
    r->on_future_ = nullptr;
    std::lock_guard<std::mutex> g(mu_);
    if (coalescing_) coalesced_.push_back(r);
  }

  // Drop ended works (complete those that ended: each poll never blocks)
  void sweep(bool all) {
    std::vector<c10::intrusive_ptr<R2Work>> look;
    {
      std::lock_guard<std::mutex> g(mu_);
      look.assign(inflight_.begin(), inflight_.end());
    }
    for (auto& w : look) w->poll();
    std::lock_guard<std::mutex> g(mu_);
    std::deque<c10::intrusive_ptr<R2Work>> keep;
    for (auto& w : inflight_)
      if (!w->done()) keep.push_back(w);
    inflight_.swap(keep);
    sweep_at_ = std::max<size_t>(64, 2 * inflight_.size());
    (void)all;
  }

  c10::intrusive_ptr<c10d::Work> join(std::vector<c10::intrusive_ptr<R2Work>> parts,
                                      const std::vector<at::Tensor>& outs, bool async) {
    auto w = c10::make_intrusive<JoinWork>(getRank(), std::move(parts), outs);
    c10::intrusive_ptr<R2Work> r = w;
    if (!async) {
      r->complete(-1);
      return r;
    }
    auto c = completer_;
    r->on_future_ = [c](R2Work* x) { c->put(c10::intrusive_ptr<R2Work>::reclaim_copy(x)); };
    return r;
  }

  // An operation of pyops (Python): its handle wrapped as a Work
  template <class Args>
  c10::intrusive_ptr<c10d::Work> py_call(const char* name, c10d::OpType type,
                                         const std::vector<at::Tensor>& outs, Args make_args) {
    py::gil_scoped_acquire g;
    py::tuple args = make_args();
    py::object handle = ops_.attr(name)(*args);  // raises pyops' errors (R2comm's classes)
    issued_.fetch_add(1);
    std::string title = std::string("r2comm:") + name;
    auto w = c10::make_intrusive<PyWork>(getRank(), type,
                                         at::hasCallbacks() ? title.c_str() : nullptr, outs,
                                         std::move(handle));
    c10::intrusive_ptr<R2Work> r = w;
    py::gil_scoped_release nogil;
    return hold(r);
  }

  py::object ops_;
  std::shared_ptr<Channel> chan_;
  std::shared_ptr<Completer> completer_;
  std::mutex mu_;
  std::deque<c10::intrusive_ptr<R2Work>> inflight_;
  size_t sweep_at_ = 64;
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<R2Work>> coalesced_;
  std::atomic<uint64_t> issued_{0};
};

}  // namespace r2t

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::module_ dist = py::module_::import("torch.distributed");
  (void)dist;
  py::class_<r2t::R2commBackend, c10d::Backend, c10::intrusive_ptr<r2t::R2commBackend>>(
      m, "R2commBackend", "r2comm's c10d backend (r2comm/torch/_backend.cpp)",
      py::dynamic_attr())
      .def(py::init<int, int, py::object, py::object, py::object, py::object>(),
           py::arg("rank"), py::arg("size"), py::arg("comm"), py::arg("ops"),
           py::arg("engine"), py::arg("c_api"))
      .def_property_readonly("comm", &r2t::R2commBackend::comm,
                             "The r2comm Communicator of this group")
      .def_property_readonly("ops", &r2t::R2commBackend::ops,
                             "The group's Python collectives (r2comm/torch/pyops.py)")
      .def_property_readonly("pending_works", &r2t::R2commBackend::pending,
                             "Operations of this group in flight (waited for or not)");
  m.def("set_errors", [](py::object fn) { r2t::errors_fn() = std::move(fn); },
        "set_errors(fn): fn(code, message) -> the exception of an engine error");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const r2t::R2Error& e) {
      PyObject* inst = e.instance();
      if (inst == nullptr) throw;
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(inst)), inst);
    }
  });
}
