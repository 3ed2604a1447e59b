// A step captured into graphs (CUDA or HIP, one source), for the GPU backend's
// begin_capture / graph_break / end_capture (src/backends/backend.h): stream capture on the
// backend's one stream, cut into pieces where the model asks for a break, each piece
// instantiated on its own, and a replay that launches the pieces in order.
//
// Why pieces: a graph launch costs the host about half a microsecond per kernel before the
// device starts the graph's first kernel (docs/gpus.md#what-a-gpu-step-runs), so one graph of a whole
// step leaves the device idle for the whole launch, 0.2-0.4 ms a step for 30-80 layers. With
// a short first piece the device starts after its launch and runs it while the host
// launches the rest.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/common/gpu.h"
#include "src/backends/backend.h"

namespace kvfuse {

class StepGraphCapture {
 public:
  // `cut`: whether cut() ends a piece (false: the step is one graph; KVFUSE_GRAPH_BREAKS=0).
  StepGraphCapture(cudaStream_t stream, bool cut) : stream_(stream), cut_(cut) {}
  ~StepGraphCapture();
  StepGraphCapture(const StepGraphCapture&) = delete;
  StepGraphCapture& operator=(const StepGraphCapture&) = delete;

  bool open() const { return open_; }
  // Starts capturing the stream's work (thread-local mode: other threads' runtime calls
  // neither join nor break it).
  absl::Status begin();
  // While open: the work since the last cut becomes a piece and capture goes on. Otherwise,
  // or without cuts, nothing.
  absl::Status cut();
  // Ends the capture (always, even after a failure) and returns the pieces as one graph.
  absl::StatusOr<std::unique_ptr<BackendGraph>> end();

 private:
  absl::Status end_piece();  // ends the stream's capture and instantiates it into pieces_
  void drop_pieces();

  cudaStream_t stream_;
  bool cut_;
  bool open_ = false;
  std::vector<cudaGraphExec_t> pieces_;
};

}  // namespace kvfuse
