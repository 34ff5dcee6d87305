// The `het` torch.distributed backend: hierarchical collectives for groups that span islands
// whose native collective libraries cannot join one communicator (NCCL vs RCCL vs gloo).
//
// Every collective runs in three phases: inside each island through that island's own process
// group (created in Python with the island's native backend), between islands over host-staged
// gloo groups (the "bridge"), then back inside each island. All-reduce is sharded between islands:
// member j of every island exchanges piece j of the tensor (peer group j), so every member of the
// smallest island carries a share; the other collectives go through one leader per island.
// Phases run on one worker thread per backend so calls return asynchronous Work at once; large
// all-reduces are cut into chunks so intra- and inter-island phases of different chunks overlap.
// The Python twin (megatron_het/comm/python_impl.py) has the same semantics.

#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#if defined(USE_CUDA) || defined(USE_ROCM)
// On ROCm builds torch hipifies these headers and the c10::cuda names map to HIP. Only c10/cuda
// and the runtime API: ATen/cuda/CUDAEvent.h pulls cuSPARSE/cuBLAS headers (CUDAContextLight.h),
// which would tie this file to the math libraries and keep `make check-gpu-build` from compiling it
// where only the toolkit's runtime headers are installed.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace het {

using c10d::ProcessGroup;
using PG = c10::intrusive_ptr<ProcessGroup>;
using Clock = std::chrono::steady_clock;

#if defined(USE_CUDA) || defined(USE_ROCM)
// The point on the caller's stream where a collective's tensors are ready (what at::cuda::CUDAEvent
// did here: an event without timing, recorded on the caller's stream, waited on by a pool stream).
class ReadyEvent {
 public:
  explicit ReadyEvent(const c10::cuda::CUDAStream& stream) : device_(stream.device_index()) {
    c10::cuda::CUDAGuard guard(device_);
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(event_, stream.stream()));
  }
  ReadyEvent(const ReadyEvent&) = delete;
  ReadyEvent& operator=(const ReadyEvent&) = delete;
  ~ReadyEvent() {
    try {  // a destructor must not throw (e.g. during CUDA shutdown): the event is then gone anyway
      c10::cuda::CUDAGuard guard(device_);
      (void)cudaEventDestroy(event_);
    } catch (...) {
    }
  }
  // Make `stream` wait for the recorded point (device-side; the host does not block).
  void block(const c10::cuda::CUDAStream& stream) const {
    c10::cuda::CUDAGuard guard(stream.device_index());
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), event_, 0));
  }

 private:
  c10::DeviceIndex device_;
  cudaEvent_t event_ = nullptr;
};
#endif

// Work whose completion is a Future set by the worker thread.
class FutureWork : public c10d::Work {
 public:
  FutureWork(int rank, c10d::OpType op, c10::intrusive_ptr<c10::ivalue::Future> fut)
      : Work(rank, op), fut_(std::move(fut)) {}
  bool isCompleted() override { return fut_->completed(); }
  bool isSuccess() const override { return fut_->completed() && !fut_->hasError(); }
  // `timeout` (kNoTimeout: wait until the worker finishes) bounds the caller's wait; the collective
  // itself stays bounded by the group's timeout on the worker thread.
  bool wait(std::chrono::milliseconds timeout) override {
    if (timeout == ::kNoTimeout) {
      fut_->wait();
    } else if (!waitFor(timeout)) {
      TORCH_CHECK_WITH(DistBackendError, false, "het: Work.wait timed out after ", timeout.count(),
                       " ms; the collective is still queued or running on the group's worker thread. Fix: wait "
                       "longer, or check that every rank of the group calls the same collectives in the same order");
    }
    if (fut_->hasError()) {
      std::rethrow_exception(fut_->exception_ptr());
    }
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return fut_; }

 private:
  // True when the future completed within `timeout` (a callback wakes the waiter; a future already
  // complete runs it at once).
  bool waitFor(std::chrono::milliseconds timeout) {
    struct Waiter {
      std::mutex mu;
      std::condition_variable cv;
      bool done = false;
    };
    auto w = std::make_shared<Waiter>();
    fut_->addCallback([w](c10::ivalue::Future&) {
      {
        std::lock_guard<std::mutex> g(w->mu);
        w->done = true;
      }
      w->cv.notify_all();
    });
    std::unique_lock<std::mutex> g(w->mu);
    return w->cv.wait_for(g, timeout, [&] { return w->done; });
  }

  c10::intrusive_ptr<c10::ivalue::Future> fut_;
};

// Work wrapping an inner p2p Work plus a step to run after it (copy a staged host buffer back).
class StagedWork : public c10d::Work {
 public:
  StagedWork(int rank, c10d::OpType op, c10::intrusive_ptr<c10d::Work> inner,
             std::function<void()> after)
      : Work(rank, op), inner_(std::move(inner)), after_(std::move(after)) {}
  bool isCompleted() override { return done_ || inner_->isCompleted(); }
  bool wait(std::chrono::milliseconds timeout) override {
    inner_->wait(timeout);
    if (!done_) {
      if (after_) after_();
      done_ = true;
    }
    return true;
  }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::function<void()> after_;
  bool done_ = false;
};

class HetBackend : public c10d::Backend {
 public:
  // island_of_rank / intra_rank_of_rank are indexed by group rank; leader_of_island by island
  // index (islands ordered by their leader's rank, so an island's index is its leaders-group rank).
  // shards: pieces of a cross-island all-reduce (the fewest members of any island; 1 for one
  // island); peer: member j of every island for this rank's j < shards, else absent.
  HetBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size, std::string name,
             PG intra, std::optional<PG> leaders, std::optional<PG> peer, PG bridge,
             std::vector<int64_t> island_of_rank, std::vector<int64_t> intra_rank_of_rank,
             std::vector<int64_t> leader_of_island, int64_t shards, int64_t chunk_bytes,
             double link_bytes_per_s, double timeout_s)
      : Backend(rank, size), store_(std::move(store)), name_(std::move(name)),
        intra_(std::move(intra)), leaders_(leaders.value_or(PG())), peer_(peer.value_or(PG())),
        bridge_(std::move(bridge)),
        island_of_(std::move(island_of_rank)), intra_rank_of_(std::move(intra_rank_of_rank)),
        leader_of_(std::move(leader_of_island)), shards_(std::max<int64_t>(shards, 1)),
        chunk_bytes_(std::max<int64_t>(chunk_bytes, 1)),
        link_rate_(link_bytes_per_s), timeout_s_(timeout_s) {
    my_island_ = island_of_[rank];
    is_leader_ = leader_of_[my_island_] == rank;
    for (int r = 0; r < size; ++r) {
      if (island_of_[r] == my_island_) members_.push_back(r);
    }
    std::sort(members_.begin(), members_.end(),
              [&](int a, int b) { return intra_rank_of_[a] < intra_rank_of_[b]; });
    worker_ = std::thread([this] { loop(); });
  }

  ~HetBackend() override {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  const std::string getBackendName() const override { return "het"; }

  // Bytes this rank has sent across the island boundary (modelled per algorithm, see docs).
  int64_t bridgeBytes() const { return bridge_bytes_.load(); }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& ts,
                                           const c10d::AllreduceOptions& opts) override {
    auto t = single(ts, "all_reduce");
    auto op = opts.reduceOp;
    return submit(c10d::OpType::ALLREDUCE, "all_reduce", {t}, [this, t, op] { doAllreduce(t, op); });
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& ts,
                                           const c10d::BroadcastOptions& opts) override {
    auto t = single(ts, "broadcast");
    int root = static_cast<int>(opts.rootRank);
    return submit(c10d::OpType::BROADCAST, "broadcast", {t}, [this, t, root] { doBroadcast(t, root); });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outs,
                                           std::vector<at::Tensor>& ins,
                                           const c10d::AllgatherOptions&) override {
    auto in = single(ins, "all_gather");
    TORCH_CHECK(outs.size() == 1 && static_cast<int>(outs[0].size()) == size_,
                "het all_gather: need one output list of ", size_, " tensors");
    auto out = outs[0];
    return submit(c10d::OpType::ALLGATHER, "all_gather", out, [this, in, out] { doAllgather(in, out); });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outs,
                                                std::vector<std::vector<at::Tensor>>& ins,
                                                const c10d::ReduceScatterOptions& opts) override {
    auto out = single(outs, "reduce_scatter");
    TORCH_CHECK(ins.size() == 1 && static_cast<int>(ins[0].size()) == size_,
                "het reduce_scatter: need one input list of ", size_, " tensors");
    auto in = ins[0];
    auto op = opts.reduceOp;
    return submit(c10d::OpType::REDUCE_SCATTER, "reduce_scatter", {out},
                  [this, in, out, op] { doReduceScatter(in, out, op); });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    return submit(c10d::OpType::BARRIER, "barrier", {}, [this] {
      auto t = at::zeros({1});
      runAllreduce(t, c10d::ReduceOp::SUM);
    });
  }

  // Point-to-point: same island -> the island's native group; across islands -> the host-staged
  // bridge. Issued from the caller thread (not the worker) so a send and the matching recv can
  // both be posted before either waits.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& ts, int dst, int tag) override {
    auto t = single(ts, "send");
    if (island_of_[dst] == my_island_) {
      std::vector<at::Tensor> v{t};
      return intra_->send(v, static_cast<int>(intra_rank_of_[dst]), tag);
    }
    auto host = stage(t);
    throttle(t.numel() * t.element_size());
    std::vector<at::Tensor> v{host};
    return c10::make_intrusive<StagedWork>(rank_, c10d::OpType::SEND, bridge_->send(v, dst, tag),
                                           [host] {});
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& ts, int src, int tag) override {
    auto t = single(ts, "recv");
    if (island_of_[src] == my_island_) {
      std::vector<at::Tensor> v{t};
      return intra_->recv(v, static_cast<int>(intra_rank_of_[src]), tag);
    }
    bool direct = t.is_cpu() && t.is_contiguous();
    at::Tensor host = direct ? t : at::empty(t.sizes(), t.options().device(at::kCPU));
    std::vector<at::Tensor> v{host};
    return c10::make_intrusive<StagedWork>(rank_, c10d::OpType::RECV, bridge_->recv(v, src, tag),
                                           [t, host, direct]() mutable {
                                             if (!direct) t.copy_(host);
                                           });
  }

 private:
  using Job = std::function<void()>;

  static at::Tensor single(std::vector<at::Tensor>& ts, const char* op) {
    TORCH_CHECK(ts.size() == 1, "het ", op, ": expected exactly one tensor, got ", ts.size());
    return ts[0];
  }

  // Queue `job` on the worker; record entry into collective #seq in the store so a peer that
  // times out can name the ranks that never arrived.
  c10::intrusive_ptr<c10d::Work> submit(c10d::OpType type, const std::string& op,
                                        std::vector<at::Tensor> outputs, Job job) {
    int64_t seq = ++seq_;
    std::string s = std::to_string(seq);
    store_->set("seq/" + std::to_string(rank_), std::vector<uint8_t>(s.begin(), s.end()));
    auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
#if defined(USE_CUDA) || defined(USE_ROCM)
    // The worker must not read device tensors before the caller's stream has produced them.
    std::shared_ptr<ReadyEvent> ready;
    for (auto& t : outputs) {
      if (t.is_cuda()) {
        ready = std::make_shared<ReadyEvent>(c10::cuda::getCurrentCUDAStream(t.device().index()));
        break;
      }
    }
#endif
    auto start = Clock::now();
    Job wrapped = [=, this]() {
      try {
#if defined(USE_CUDA) || defined(USE_ROCM)
        std::optional<c10::cuda::CUDAStreamGuard> guard;
        if (ready) {
          auto stream = c10::cuda::getStreamFromPool(false, outputs[0].device().index());
          guard.emplace(stream);
          ready->block(stream);
        }
#endif
        job();
#if defined(USE_CUDA) || defined(USE_ROCM)
        if (ready) c10::cuda::getCurrentCUDAStream(outputs[0].device().index()).synchronize();
#endif
        fut->markCompleted(c10::IValue(outputs));
      } catch (const std::exception& e) {
        double waited = std::chrono::duration<double>(Clock::now() - start).count();
        fut->setError(std::make_exception_ptr(
            c10::DistBackendError(diagnose(op, seq, waited, e.what()), nullptr)));
      }
    };
    {
      std::lock_guard<std::mutex> g(mu_);
      jobs_.push_back(std::move(wrapped));
    }
    cv_.notify_one();
    return c10::make_intrusive<FutureWork>(rank_, type, fut);
  }

  static std::string firstLine(const char* text) {
    std::string s(text);
    return s.substr(0, s.find('\n'));
  }

  // Name the group, this rank, and every rank whose last entered collective is before `seq`;
  // stops at the first store error (one store timeout, not one per rank).
  std::string diagnose(const std::string& op, int64_t seq, double waited, const char* cause) {
    std::ostringstream missing;
    std::string unreachable;
    int n_missing = 0;
    for (int r = 0; r < size_; ++r) {
      std::string key = "seq/" + std::to_string(r);
      int64_t theirs = 0;
      try {
        if (store_->check({key})) {
          auto v = store_->get(key);
          theirs = std::stoll(std::string(v.begin(), v.end()));
        }
      } catch (const std::exception& e) {
        // The store itself is gone: every further read would wait out its timeout too.
        unreachable = "; the store is unreachable (" + firstLine(e.what()) + "), ranks " + std::to_string(r) +
                      ".." + std::to_string(size_ - 1) + " not checked";
        break;
      }
      if (theirs < seq) {
        missing << (n_missing++ ? ", " : "") << "rank " << r << " (last entered #" << theirs << ")";
      }
    }
    std::ostringstream msg;
    msg << "het group '" << name_ << "': rank " << rank_ << " " << op << " #" << seq
        << " failed after " << waited << " s (timeout " << timeout_s_ << " s); "
        << (n_missing ? "ranks that never entered it: " + missing.str()
                      : std::string(unreachable.empty() ? "every rank entered it" : "no rank found behind"))
        << unreachable
        << ". Check that every rank of the group calls the same collectives in the same order. "
        << "Cause: " << cause;
    return msg.str();
  }

  void loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [this] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  int islands() const { return static_cast<int>(leader_of_.size()); }
  int islandSize() const { return static_cast<int>(members_.size()); }

  // Emulated slow inter-island link: the sending rank sleeps bytes / rate, each on its own (one
  // link per rank; 0 disables the emulation).
  void throttle(int64_t bytes) {
    bridge_bytes_ += bytes;
    if (link_rate_ > 0) {
      std::this_thread::sleep_for(std::chrono::duration<double>(bytes / link_rate_));
    }
  }

  // Host staging for the bridge: device tensors are copied to host memory (pinned on GPU builds).
  static at::Tensor stage(const at::Tensor& t) {
    if (t.is_cpu()) return t.contiguous();
#if defined(USE_CUDA) || defined(USE_ROCM)
    auto host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
    host.copy_(t, /*non_blocking=*/true);
    c10::cuda::getCurrentCUDAStream(t.device().index()).synchronize();
    return host;
#else
    return t.to(at::kCPU);
#endif
  }

  static void wait(const c10::intrusive_ptr<c10d::Work>& w) { w->wait(); }

  static c10d::ReduceOp base(const c10d::ReduceOp& op) {
    return op.op_ == c10d::ReduceOp::AVG ? c10d::ReduceOp(c10d::ReduceOp::SUM) : op;
  }

  void doAllreduce(at::Tensor t, c10d::ReduceOp op) {
    at::Tensor flat = t.is_contiguous() ? t.view({-1}) : t.contiguous().view({-1});
    runAllreduce(flat, base(op));
    if (op.op_ == c10d::ReduceOp::AVG) flat.div_(size_);
    if (!t.is_contiguous()) t.copy_(flat.view(t.sizes()));
  }

  // Sharded across islands (the Python twin's _all_reduce_flat has the same phases and says why
  // per-shard reduces and broadcasts, not reduce-scatter / all-gather): the tensor is cut into
  // shards_ = S contiguous pieces (the first numel % S one longer); inside each island shard j is
  // reduced to member j, member j of every island all-reduces it over its own link (peer_), and
  // each shard is broadcast back from its holder. S = 1 is the leader algorithm. Shards are cut
  // into chunks: chunk c's exchange runs while the holder spends chunk c+1's link time, so no phase
  // waits for the whole tensor. Intra-island ops are issued in the same order on every member
  // (gloo matches collectives by issue order): all reduces first, then chunk by chunk the
  // broadcasts.
  void runAllreduce(at::Tensor flat, c10d::ReduceOp op) {
    int64_t per = std::max<int64_t>(1, chunk_bytes_ / flat.element_size());
    int64_t S = shards_, m = islandSize(), k = islands();
    int64_t j = intra_rank_of_[rank_];  // this rank holds shard j when j < S
    std::vector<std::vector<at::Tensor>> pieces(S);
    size_t n = 0;
    for (int64_t s = 0, off = 0; s < S; ++s) {
      int64_t len = flat.numel() / S + (s < flat.numel() % S ? 1 : 0);
      if (len > 0) pieces[s] = flat.narrow(0, off, len).split(per);
      off += len;
      n = std::max(n, pieces[s].size());
    }
    // row c: chunk c of every shard that has one (shards shrink with s, so always a prefix)
    std::vector<std::vector<at::Tensor>> rows(n);
    for (size_t c = 0; c < n; ++c)
      for (int64_t s = 0; s < S; ++s)
        if (c < pieces[s].size()) rows[c].push_back(pieces[s][c]);
    std::vector<std::vector<c10::intrusive_ptr<c10d::Work>>> reducing(n);
    if (m > 1) {
      for (size_t c = 0; c < n; ++c) {
        for (size_t s = 0; s < rows[c].size(); ++s) {
          c10d::ReduceOptions ro;
          ro.reduceOp = op;
          ro.rootRank = static_cast<int64_t>(s);
          std::vector<at::Tensor> v{rows[c][s]};
          reducing[c].push_back(intra_->reduce(v, ro));
        }
      }
    }
    auto reduced = [&](size_t c) {  // gloo may run ops concurrently: never send over a live reduce
      for (auto& w : reducing[c]) wait(w);
      reducing[c].clear();
    };
    std::vector<at::Tensor> staged(n);
    std::vector<c10::intrusive_ptr<c10d::Work>> exchanging(n);
    c10d::AllreduceOptions ao;
    ao.reduceOp = op;
    auto exchange = [&](size_t c) {  // shard j's chunk c to the other islands' holders of shard j
      reduced(c);
      staged[c] = stage(rows[c][j]);
      throttle(2 * (k - 1) * staged[c].numel() * staged[c].element_size() / k);  // ring model
      std::vector<at::Tensor> v{staged[c]};
      exchanging[c] = peer_->allreduce(v, ao);
    };
    std::vector<c10::intrusive_ptr<c10d::Work>> sends;
    auto send_back = [&](size_t c) {  // chunk c of every shard from its holder to the island
      reduced(c);
      if (exchanging[c].defined()) {
        wait(exchanging[c]);
        if (!staged[c].is_same(rows[c][j])) rows[c][j].copy_(staged[c]);
        exchanging[c].reset();
      }
      if (m == 1) return;
      for (size_t s = 0; s < rows[c].size(); ++s) {
        c10d::BroadcastOptions bo;
        bo.rootRank = static_cast<int64_t>(s);
        std::vector<at::Tensor> v{rows[c][s]};
        sends.push_back(intra_->broadcast(v, bo));
      }
    };
    size_t mine = (j < S && k > 1) ? pieces[j].size() : 0;
    for (size_t c = 0; c < n; ++c) {
      if (c < mine) exchange(c);
      if (c > 0) send_back(c - 1);
    }
    if (n > 0) send_back(n - 1);
    for (auto& w : sends) wait(w);
  }

  void doBroadcast(at::Tensor t, int root) {
    at::Tensor buf = t.contiguous();
    int64_t root_island = island_of_[root];
    if (islandSize() > 1 && root_island == my_island_) {
      c10d::BroadcastOptions bo;
      bo.rootRank = intra_rank_of_[root];
      std::vector<at::Tensor> v{buf};
      wait(intra_->broadcast(v, bo));
    }
    if (is_leader_ && islands() > 1) {
      auto host = stage(buf);
      if (root_island == my_island_) throttle(host.numel() * host.element_size());
      c10d::BroadcastOptions bo;
      bo.rootRank = root_island;
      std::vector<at::Tensor> v{host};
      wait(leaders_->broadcast(v, bo));
      if (!host.is_same(buf)) buf.copy_(host);
    }
    if (islandSize() > 1 && root_island != my_island_) {
      c10d::BroadcastOptions bo;
      bo.rootRank = 0;
      std::vector<at::Tensor> v{buf};
      wait(intra_->broadcast(v, bo));
    }
    if (!buf.is_same(t)) t.copy_(buf);
  }

  // Uneven sizes: ranks pad to the island's largest piece for the intra gather, leaders pad
  // island blocks to the largest block for the bridge all-gather, then the exact concatenation
  // is broadcast inside each island and cut into the outputs.
  void doAllgather(at::Tensor in, std::vector<at::Tensor> outs) {
    auto opts = in.options();
    std::vector<int64_t> sz(size_);
    for (int r = 0; r < size_; ++r) sz[r] = outs[r].numel();
    int k = islands();
    std::vector<std::vector<int>> members(k);
    for (int r = 0; r < size_; ++r) members[island_of_[r]].push_back(r);
    for (auto& m : members)
      std::sort(m.begin(), m.end(), [&](int a, int b) { return intra_rank_of_[a] < intra_rank_of_[b]; });
    std::vector<int64_t> block(k, 0), isl_max(k, 0);
    for (int i = 0; i < k; ++i)
      for (int r : members[i]) {
        block[i] += sz[r];
        isl_max[i] = std::max(isl_max[i], sz[r]);
      }
    int64_t total = 0, max_block = 0;
    for (int i = 0; i < k; ++i) {
      total += block[i];
      max_block = std::max(max_block, block[i]);
    }
    at::Tensor full = at::empty({total}, opts);
    std::vector<int64_t> block_off(k, 0);
    for (int i = 1; i < k; ++i) block_off[i] = block_off[i - 1] + block[i - 1];
    // Phase 1: island block at the leader.
    at::Tensor mine = full.narrow(0, block_off[my_island_], block[my_island_]);
    int64_t pad = isl_max[my_island_];
    if (islandSize() > 1) {
      at::Tensor piece = at::zeros({pad}, opts);
      piece.narrow(0, 0, sz[rank_]).copy_(in.reshape({-1}));
      std::vector<at::Tensor> inv{piece};
      std::vector<std::vector<at::Tensor>> outv;
      if (is_leader_) {
        outv.emplace_back();
        for (int j = 0; j < islandSize(); ++j) outv[0].push_back(at::empty({pad}, opts));
      }
      c10d::GatherOptions go;
      go.rootRank = 0;
      wait(intra_->gather(outv, inv, go));
      if (is_leader_) {
        int64_t off = 0;
        for (int j = 0; j < islandSize(); ++j) {
          int64_t s = sz[members[my_island_][j]];
          mine.narrow(0, off, s).copy_(outv[0][j].narrow(0, 0, s));
          off += s;
        }
      }
    } else {
      mine.copy_(in.reshape({-1}));
    }
    // Phase 2: leaders exchange island blocks over the bridge.
    if (is_leader_ && k > 1) {
      auto cpu = opts.device(at::kCPU);
      at::Tensor send = at::zeros({max_block}, cpu);
      send.narrow(0, 0, block[my_island_]).copy_(mine);
      std::vector<std::vector<at::Tensor>> outv(1);
      for (int i = 0; i < k; ++i) outv[0].push_back(at::empty({max_block}, cpu));
      throttle((k - 1) * max_block * send.element_size());
      std::vector<at::Tensor> inv{send};
      wait(leaders_->allgather(outv, inv));
      for (int i = 0; i < k; ++i)
        if (i != my_island_) full.narrow(0, block_off[i], block[i]).copy_(outv[0][i].narrow(0, 0, block[i]));
    }
    // Phase 3: the whole concatenation to every island member.
    if (islandSize() > 1) {
      c10d::BroadcastOptions bo;
      bo.rootRank = 0;
      std::vector<at::Tensor> v{full};
      wait(intra_->broadcast(v, bo));
    }
    for (int i = 0; i < k; ++i) {
      int64_t off = block_off[i];
      for (int r : members[i]) {
        outs[r].copy_(full.narrow(0, off, sz[r]).view(outs[r].sizes()));
        off += sz[r];
      }
    }
  }

  // Inputs are laid out island by island; the island reduces the whole buffer to its leader,
  // leaders reduce-scatter padded island blocks over the bridge, and each leader scatters its
  // block to the island members.
  void doReduceScatter(std::vector<at::Tensor> ins, at::Tensor out, c10d::ReduceOp op) {
    auto opts = out.options();
    auto rop = base(op);
    int k = islands();
    std::vector<std::vector<int>> members(k);
    for (int r = 0; r < size_; ++r) members[island_of_[r]].push_back(r);
    for (auto& m : members)
      std::sort(m.begin(), m.end(), [&](int a, int b) { return intra_rank_of_[a] < intra_rank_of_[b]; });
    std::vector<int64_t> block(k, 0);
    for (int i = 0; i < k; ++i)
      for (int r : members[i]) block[i] += ins[r].numel();
    int64_t max_block = *std::max_element(block.begin(), block.end());
    // Island-ordered, block-padded buffer so the bridge can reduce-scatter equal pieces.
    at::Tensor buf = at::zeros({k * max_block}, opts);
    for (int i = 0; i < k; ++i) {
      int64_t off = i * max_block;
      for (int r : members[i]) {
        buf.narrow(0, off, ins[r].numel()).copy_(ins[r].reshape({-1}));
        off += ins[r].numel();
      }
    }
    if (islandSize() > 1) {
      c10d::ReduceOptions ro;
      ro.reduceOp = rop;
      ro.rootRank = 0;
      std::vector<at::Tensor> v{buf};
      wait(intra_->reduce(v, ro));
    }
    at::Tensor mine = buf.narrow(0, my_island_ * max_block, max_block);
    if (is_leader_ && k > 1) {
      auto host = stage(buf);
      at::Tensor got = at::empty({max_block}, host.options());
      std::vector<std::vector<at::Tensor>> inv(1);
      for (int i = 0; i < k; ++i) inv[0].push_back(host.narrow(0, i * max_block, max_block));
      std::vector<at::Tensor> outv{got};
      c10d::ReduceScatterOptions rso;
      rso.reduceOp = rop;
      throttle((k - 1) * max_block * host.element_size());
      wait(leaders_->reduce_scatter(outv, inv, rso));
      mine.copy_(got);
    }
    int64_t pad = 0;
    for (int r : members[my_island_]) pad = std::max(pad, ins[r].numel());
    if (islandSize() > 1) {
      std::vector<std::vector<at::Tensor>> inv;
      if (is_leader_) {
        inv.emplace_back();
        int64_t off = 0;
        for (int r : members[my_island_]) {
          at::Tensor p = at::zeros({pad}, opts);
          p.narrow(0, 0, ins[r].numel()).copy_(mine.narrow(0, off, ins[r].numel()));
          off += ins[r].numel();
          inv[0].push_back(p);
        }
      }
      at::Tensor got = at::empty({pad}, opts);
      std::vector<at::Tensor> outv{got};
      c10d::ScatterOptions so;
      so.rootRank = 0;
      wait(intra_->scatter(outv, inv, so));
      out.copy_(got.narrow(0, 0, out.numel()).view(out.sizes()));
    } else {
      out.copy_(mine.narrow(0, 0, out.numel()).view(out.sizes()));
    }
    if (op.op_ == c10d::ReduceOp::AVG) out.div_(size_);
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::string name_;
  PG intra_;    // this rank's island, native backend
  PG leaders_;  // one rank per island, gloo (null on non-leaders)
  PG peer_;     // member j of every island, gloo: exchanges all-reduce shard j (null when j >= shards)
  PG bridge_;   // every rank of the group, gloo: cross-island send/recv
  std::vector<int64_t> island_of_, intra_rank_of_, leader_of_;
  int64_t shards_;
  std::vector<int> members_;
  int64_t my_island_ = 0;
  bool is_leader_ = false;
  int64_t chunk_bytes_;
  double link_rate_;
  double timeout_s_;
  std::atomic<int64_t> seq_{0};
  std::atomic<int64_t> bridge_bytes_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace het

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "het: hierarchical cross-island torch.distributed backend";
  m.attr("GPU_BUILD") =
#if defined(USE_ROCM)
      "rocm";
#elif defined(USE_CUDA)
      "cuda";
#else
      "none";
#endif
  py::module::import("torch.distributed");  // registers the c10d::Backend base type
  py::class_<het::HetBackend, c10::intrusive_ptr<het::HetBackend>, c10d::Backend>(m, "HetBackend")
      .def(py::init<c10::intrusive_ptr<c10d::Store>, int, int, std::string, het::PG,
                    std::optional<het::PG>, std::optional<het::PG>, het::PG, std::vector<int64_t>,
                    std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t, double, double>(),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("name"), py::arg("intra"),
           py::arg("leaders"), py::arg("peer"), py::arg("bridge"), py::arg("island_of_rank"),
           py::arg("intra_rank_of_rank"), py::arg("leader_of_island"), py::arg("shards"), py::arg("chunk_bytes"),
           py::arg("link_bytes_per_s"), py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>())
      .def("bridge_bytes", &het::HetBackend::bridgeBytes);
}
