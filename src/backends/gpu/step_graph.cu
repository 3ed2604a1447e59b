// A step captured into graphs, in pieces (src/backends/gpu/step_graph.h).
#include "src/backends/gpu/step_graph.h"

#include <utility>

#include "src/backends/gpu/gpu_status.h"
#include "src/common/status_macros.h"

namespace kvfuse {
namespace {

class StepGraph final : public BackendGraph {
 public:
  StepGraph(std::vector<cudaGraphExec_t> pieces, cudaStream_t stream) : pieces_(std::move(pieces)), stream_(stream) {}
  ~StepGraph() override {
    for (cudaGraphExec_t e : pieces_) (void)cudaGraphExecDestroy(e);  // best effort, as in ~GpuBackend
  }
  absl::Status replay() override {
    for (cudaGraphExec_t e : pieces_) KVFUSE_CUDA(cudaGraphLaunch(e, stream_));
    return absl::OkStatus();
  }

 private:
  std::vector<cudaGraphExec_t> pieces_;
  cudaStream_t stream_;
};

}  // namespace

StepGraphCapture::~StepGraphCapture() { drop_pieces(); }

void StepGraphCapture::drop_pieces() {
  for (cudaGraphExec_t e : pieces_) (void)cudaGraphExecDestroy(e);
  pieces_.clear();
}

absl::Status StepGraphCapture::begin() {
  if (open_) return absl::FailedPreconditionError("begin_capture: a capture is already open");
  drop_pieces();
  KVFUSE_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  open_ = true;
  return absl::OkStatus();
}

absl::Status StepGraphCapture::end_piece() {
  open_ = false;
  cudaGraph_t graph = nullptr;
  KVFUSE_CUDA(cudaStreamEndCapture(stream_, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  const cudaError_t destroyed = cudaGraphDestroy(graph);  // the exec holds what it needs
  KVFUSE_CUDA(err);
  pieces_.push_back(exec);
  KVFUSE_CUDA(destroyed);
  return absl::OkStatus();
}

absl::Status StepGraphCapture::cut() {
  if (!open_ || !cut_) return absl::OkStatus();
  KVFUSE_RETURN_IF_ERROR(end_piece());
  KVFUSE_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  open_ = true;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<BackendGraph>> StepGraphCapture::end() {
  if (!open_) return absl::FailedPreconditionError("end_capture without begin_capture");
  const absl::Status ended = end_piece();
  if (!ended.ok()) {
    drop_pieces();
    return ended;
  }
  std::unique_ptr<BackendGraph> graph(new StepGraph(std::move(pieces_), stream_));
  pieces_.clear();
  return graph;
}

}  // namespace kvfuse
