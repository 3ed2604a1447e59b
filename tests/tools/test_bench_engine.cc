// kvfuse-bench-engine: the roofline byte counting against hand-computed figures, and a
// smoke run of the real binary on the CPU with the tiny model; bench/common's peak
// bandwidth table, JSON results layout and kernel-benchmark arguments.
#include <stdlib.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "tests/util/catch.h"
#include "tests/util/checkpoint_test_util.h"
#include "tests/util/run_command.h"

#include "bench/common/args.h"
#include "bench/common/device_info.h"
#include "bench/common/json_writer.h"
#include "bench/common/peak_bandwidth.h"
#include "bench/engine/engine_cells.h"
#include "bench/engine/roofline.h"
#include "src/loading/model_spec.h"

using namespace kvfuse;
using namespace kvfuse::bench;
using kvfuse::testing::TempDir;

namespace {

ModelSpec preset(const std::string& name) {
  auto s = model_preset(name);
  REQUIRE(s.ok());
  return *s;
}

// llama3-8b: vocab 128256, hidden 4096, intermediate 14336, 32 layers, 32 q heads,
// 8 kv heads, head_dim 128, untied.
constexpr int64_t kLlamaLayerParams = 4096LL * (4096 + 2 * 1024)  // qkv
                                      + 4096LL * 4096             // o
                                      + 2LL * 14336 * 4096        // gate_up
                                      + 14336LL * 4096            // down
                                      + 2LL * 4096;               // attn and ffn norms
static_assert(kLlamaLayerParams == 218112000);
// Layers, final norm, lm_head; the untied embedding table is not read as a whole.
constexpr int64_t kLlamaWeightBytes = 2 * (32 * kLlamaLayerParams + 4096 + 128256LL * 4096);
static_assert(kLlamaWeightBytes == 15009849344LL);

std::pair<int, std::string> run(const std::string& cmd) { return kvfuse::testing::run_command(cmd); }

nlohmann::json read_json(const std::filesystem::path& p) {
  std::ifstream in(p);
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

}  // namespace

TEST_CASE("bench engine roofline: llama3-8b weights and full-layer KV bytes", "[bench][roofline]") {
  const ModelSpec s = preset("llama3-8b");
  CHECK(decode_weight_bytes(s) == kLlamaWeightBytes);
  // Batch 8, context 2048, fp8: 8 seqs x 32 layers x 2048 keys x 8 heads x 128 x (K, V) x 1 byte = 1 GiB.
  CHECK(decode_kv_bytes_per_seq(s, 2048, 1) == 32LL * 2048 * 8 * 128 * 2);
  CHECK(decode_step_bytes(s, 8, 2048, 1) == kLlamaWeightBytes + (int64_t(1) << 30));
  CHECK(decode_step_bytes(s, 8, 2048, 2) == kLlamaWeightBytes + (int64_t(2) << 30));
  // 16,083,591,168 bytes at 4800 GB/s (4.8e12 bytes/s): 3.3507 ms.
  CHECK(roofline_ms(double(decode_step_bytes(s, 8, 2048, 1)), 4800) == Approx(16083591168.0 / 4.8e12 * 1e3));
  CHECK(roofline_ms(4.8e9, 4800) == Approx(1.0));

  // Tied embeddings: the table is the lm_head, read once; the byte count is unchanged.
  ModelSpec tied = s;
  tied.tie_embeddings = true;
  CHECK(decode_weight_bytes(tied) == kLlamaWeightBytes);
  // Without tying, the embedding table is excluded: weights are params minus vocab x hidden.
  CHECK(decode_weight_bytes(s) == 2 * (s.num_params() - int64_t(s.vocab) * s.hidden));
}

TEST_CASE("bench engine roofline: FP8 weights count a byte a weight and their scales", "[bench][roofline]") {
  const ModelSpec s = preset("llama3-8b");
  const ModelSpec f = preset("llama3-8b-fp8");
  // Per layer: the projections' weights (qkv 6144, o 4096, gate_up 28672, down 4096 rows)
  // at 1 byte instead of 2, plus a 4-byte scale per row; embeddings, norms, lm_head bf16.
  const int64_t proj = 4096LL * 6144 + 4096LL * 4096 + 2 * 4096LL * 14336 + 14336LL * 4096;
  const int64_t rows = 6144 + 4096 + 2 * 14336 + 4096;
  CHECK(decode_weight_bytes(f) == kLlamaWeightBytes - 32 * (proj - 4 * rows));
  CHECK(decode_step_bytes(f, 8, 2048, 1) == decode_weight_bytes(f) + (int64_t(1) << 30));
  CHECK(decode_weight_bytes(s) == kLlamaWeightBytes);
}

TEST_CASE("bench engine roofline: hybrid-swa caps window layers at the window", "[bench][roofline]") {
  const ModelSpec s = preset("hybrid-swa");  // 16 window layers (4096 keys), 16 full layers
  REQUIRE(s.sliding_window == 4096);
  CHECK(decode_weight_bytes(s) == kLlamaWeightBytes);  // llama3-8b shapes
  const int64_t per_key_layer = 8 * 128 * 2 * 2;       // kv heads x head_dim x (K, V) x bf16
  // Below the window every layer reads the whole context.
  CHECK(decode_kv_bytes_per_seq(s, 1000, 2) == 32 * 1000 * per_key_layer);
  CHECK(decode_kv_bytes_per_seq(s, 4096, 2) == 32 * 4096 * per_key_layer);
  // Beyond it, window layers read 4096 keys, full layers the context.
  CHECK(decode_kv_bytes_per_seq(s, 8192, 2) == (16 * 8192 + 16 * 4096) * per_key_layer);
  CHECK(decode_step_bytes(s, 2, 8192, 2) == kLlamaWeightBytes + 2 * (16 * 8192 + 16 * 4096) * per_key_layer);
  // mistral-7b: the window on every layer.
  const ModelSpec m = preset("mistral-7b");
  CHECK(decode_kv_bytes_per_seq(m, 32768, 1) == 32LL * 4096 * 8 * 128 * 2);
}

TEST_CASE("bench engine roofline: KV pool footprint of a cell", "[bench][roofline]") {
  const ModelSpec tiny = preset("tiny");  // 4 layers, 2 kv heads, head_dim 64
  // 100 tokens in pages of 16: 7 pages + 1 spare per sequence; a page of one layer holds
  // 16 x 2 x 64 x (K, V) x 1 byte = 4096 bytes.
  const KvFootprint f = kv_footprint(tiny, 16, 1, 2, 100, 512);
  CHECK(f.full_pages == 16);
  CHECK(f.swa_pages == 0);
  // The pool's bytes as KvStorage allocates them: the pages, and four fp32 scales a layer.
  CHECK(f.bytes == 4 * 16 * 4096 + 4 * 4 * 4);
  // hybrid-swa: window layers need the window plus a step's chunk, (4096 + 512) / 16 + 1 pages.
  const ModelSpec h = preset("hybrid-swa");
  const KvFootprint g = kv_footprint(h, 16, 1, 3, 8192, 512);
  CHECK(g.full_pages == 3 * 513);
  CHECK(g.swa_pages == 3 * 289);
  // The pages, the scales (32 layers) and the SWA slot table (an int64 per full-pool slot).
  CHECK(g.bytes == (16 * 3 * 513 + 16 * 3 * 289) * int64_t(16 * 8 * 128 * 2) + 4 * 32 * 4 + 3 * 513 * 16 * 8);
  // Short sequences: the window pool never needs more than the full table.
  CHECK(kv_footprint(h, 16, 1, 1, 64, 512).swa_pages == 5);
}

TEST_CASE("kvfuse-bench-engine: CPU smoke run writes every cell and variant", "[bench][tools]") {
  TempDir dir;
  const std::filesystem::path json_path = dir / "out.json", svg_path = dir / "out.svg";
  auto [rc, out] = run(std::string(KVFUSE_BENCH_ENGINE_BIN) +
                       " --set device=cpu --set model=tiny --batch 1,2 --context 32,64 --steps 2 --reps 3 "
                       "--warmup 1 --json " +
                       json_path.string() + " --svg " + svg_path.string());
  INFO(out);
  REQUIRE(rc == 0);
  // Graphs do nothing on the CPU: only the eager variants run, and nothing compares them.
  CHECK(out.find("graphs speedup") == std::string::npos);
  CHECK(out.find("/graphs") == std::string::npos);
  CHECK(out.find("no effect on the CPU") == std::string::npos);  // not asked for: nothing to say
  // The CPU has no memory roofline of its own: no peak, no roofline columns or line.
  CHECK(out.find("x roofline") == std::string::npos);
  CHECK(out.find("roofline ms") == std::string::npos);
  CHECK(out.find("%peak") == std::string::npos);
  CHECK(out.find("roofline:") == std::string::npos);
  CHECK(out.find("GB/s") != std::string::npos);  // the achieved bandwidth stays
  CHECK(out.find("split/unified eager") != std::string::npos);
  // Not a terminal: the progress comes as lines, one per cell, with no carriage returns.
  CHECK(out.find('\r') == std::string::npos);
  CHECK(out.find("kvfuse-bench-engine: cell 4/4 (batch 2, context 64)") != std::string::npos);
  const nlohmann::json j = read_json(json_path);
  CHECK(j["meta"]["model"] == "tiny");
  CHECK(j["meta"]["device"].get<std::string>().find("cpu") != std::string::npos);
  CHECK(j["meta"]["peak_gbs"].is_null());
  CHECK(j["meta"]["reps"] == 3);
  CHECK(j["meta"]["command_line"].get<std::string>().find("--context 32,64") != std::string::npos);
  CHECK(j["skipped"].empty());
  REQUIRE(j["cells"].size() == 4);
  std::set<std::pair<int, int>> seen;
  for (const auto& c : j["cells"]) {
    seen.insert({c["batch"].get<int>(), c["context"].get<int>()});
    REQUIRE(c["variants"].size() == 2);
    std::set<std::string> names;
    for (const auto& v : c["variants"]) {
      names.insert(v["variant"].get<std::string>());
      CHECK(v["graphs"] == false);
      CHECK(v["step_ms"].get<double>() > 0);
      CHECK(v["tokens_per_s"].get<double>() > 0);
      CHECK(v["achieved_gbs"].get<double>() > 0);
      CHECK(v["ratio_to_roofline"].is_null());
      CHECK(v["roofline_ms"].is_null());
      CHECK(v["fraction_of_peak"].is_null());
      CHECK(v["samples"].size() == 3);
      // The context grows during the run: what a step attends is at least the nominal context.
      CHECK(v["mean_context_len"].get<double>() > c["context"].get<double>());
    }
    CHECK(names == std::set<std::string>{"unified/eager", "split/eager"});
    CHECK_FALSE(c["comparisons"].contains("graphs speedup unified"));
    CHECK(c["comparisons"].contains("split/unified eager"));
  }
  CHECK(seen == std::set<std::pair<int, int>>{{1, 32}, {1, 64}, {2, 32}, {2, 64}});
  std::ifstream svg(svg_path);
  const std::string text((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  CHECK(text.find("<svg") != std::string::npos);
  CHECK(text.find("context 64") != std::string::npos);
  CHECK(text.find("roofline") == std::string::npos);
}

TEST_CASE("kvfuse-bench-engine: on the CPU --peak-gbs brings the roofline columns", "[bench][tools]") {
  TempDir dir;
  const std::filesystem::path json_path = dir / "out.json", svg_path = dir / "out.svg";
  auto [rc, out] = run(std::string(KVFUSE_BENCH_ENGINE_BIN) +
                       " --set device=cpu --set model=tiny --batch 1 --context 32 --attention unified "
                       "--steps 1 --reps 3 --warmup 0 --peak-gbs 100 --json " +
                       json_path.string() + " --svg " + svg_path.string());
  INFO(out);
  REQUIRE(rc == 0);
  CHECK(out.find("x roofline") != std::string::npos);
  CHECK(out.find("roofline ms") != std::string::npos);
  CHECK(out.find("%peak") != std::string::npos);
  CHECK(out.find("at a peak of 100 GB/s (--peak-gbs)") != std::string::npos);
  const nlohmann::json j = read_json(json_path);
  CHECK(j["meta"]["peak_gbs"].get<double>() == 100.0);
  CHECK(j["meta"]["peak_source"] == "--peak-gbs");
  REQUIRE(j["cells"].size() == 1);
  const auto& v = j["cells"][0]["variants"][0];
  // step time / (bytes at 100 GB/s), from the figures the JSON carries.
  CHECK(v["roofline_ms"].get<double>() == Approx(v["bytes_per_step"].get<double>() / 1e11 * 1e3));
  CHECK(v["ratio_to_roofline"].get<double>() > 0);
  CHECK(v["fraction_of_peak"].get<double>() == Approx(v["achieved_gbs"].get<double>() / 100.0));
  std::ifstream svg(svg_path);
  const std::string text((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  CHECK(text.find("step time / roofline") != std::string::npos);
}

TEST_CASE("kvfuse-bench-engine: --graphs on says once that the CPU ignores it, and runs eager",
          "[bench][tools]") {
  TempDir dir;
  const std::filesystem::path json_path = dir / "out.json";
  auto [rc, out] = run(std::string(KVFUSE_BENCH_ENGINE_BIN) +
                       " --set device=cpu --set model=tiny --batch 1,2 --context 32 --attention unified "
                       "--graphs on --steps 1 --reps 3 --warmup 1 --json " +
                       json_path.string());
  INFO(out);
  REQUIRE(rc == 0);
  const std::string note = "graphs have no effect on the CPU backend";
  const size_t at = out.find(note);
  REQUIRE(at != std::string::npos);
  CHECK(out.find(note, at + 1) == std::string::npos);  // once, not per cell
  CHECK(out.find("graphs speedup") == std::string::npos);
  const nlohmann::json j = read_json(json_path);
  REQUIRE(j["cells"].size() == 2);
  for (const auto& c : j["cells"]) {
    REQUIRE(c["variants"].size() == 1);
    CHECK(c["variants"][0]["variant"] == "unified/eager");
    CHECK(c["variants"][0]["graphs"] == false);
  }
}

TEST_CASE("kvfuse-bench-engine: --help shows the defaults", "[bench][tools]") {
  auto [rc, out] = run(std::string(KVFUSE_BENCH_ENGINE_BIN) + " --help");
  INFO(out);
  REQUIRE(rc == 0);
  // The line of each option names its default: "--reps INT=5" (CLI11 2.1) or
  // "--reps INT [5]" (later CLI11).
  const auto shows = [&](const std::string& opt, const std::string& value) {
    const size_t at = out.find(opt + " ");
    REQUIRE(at != std::string::npos);
    const std::string line = out.substr(at, out.find('\n', at) - at);
    INFO(line);
    return line.find("=" + value) != std::string::npos || line.find("[" + value + "]") != std::string::npos;
  };
  CHECK(shows("--batch", "1,8,32,64,128,256"));
  CHECK(shows("--context", "512,2048,8192,32768"));
  CHECK(shows("--reps", "5"));
  CHECK(shows("--steps", "8"));
  CHECK(shows("--warmup", "2"));
  CHECK(shows("--attention", "unified,split"));
  CHECK(shows("--graphs", "off,on"));
}

// Config keys from KVFUSE_<KEY> variables, as every kvfuse program takes them
// (docs/configuration.md): under --set and --kv-write, over the --config file.
TEST_CASE("kvfuse-bench-engine: config keys from the environment, under the command line", "[bench][tools]") {
  const std::string cmd =
      std::string(KVFUSE_BENCH_ENGINE_BIN) +
      " --set device=cpu --set model=tiny --batch 1 --context 32 --steps 1 --reps 3 --warmup 1 "
      "--attention unified --graphs off";
  {
    auto [rc, out] = run("KVFUSE_KV_WRITE=unfused KVFUSE_KV_CACHE_DTYPE=fp8_e5m2 " + cmd);
    INFO(out);
    REQUIRE(rc == 0);
    CHECK(out.find("kv fp8_e5m2, unfused write") != std::string::npos);
  }
  {
    auto [rc, out] = run("KVFUSE_KV_WRITE=unfused " + cmd + " --set kv_write=fused_rope");
    INFO(out);
    REQUIRE(rc == 0);
    CHECK(out.find(", fused_rope write") != std::string::npos);
  }
  {
    auto [rc, out] = run("KVFUSE_KV_WRITE=sideways " + cmd);
    INFO(out);
    CHECK(rc != 0);  // a bad value is an error naming the key and the value
    CHECK(out.find("kv_write") != std::string::npos);
    CHECK(out.find("sideways") != std::string::npos);
  }
}

TEST_CASE("kvfuse-bench-engine: --kv-write makes each write path a variant of one engine", "[bench][tools]") {
  TempDir dir;
  const std::filesystem::path json_path = dir / "out.json";
  auto [rc, out] = run(std::string(KVFUSE_BENCH_ENGINE_BIN) +
                       " --set device=cpu --batch 1,2 --context 32 --attention unified --graphs off "
                       "--kv-write unfused,fused,fused_rope --steps 1 --reps 3 --warmup 1 --json " +
                       json_path.string());
  INFO(out);
  REQUIRE(rc == 0);
  CHECK(out.find("unfused,fused,fused_rope write") != std::string::npos);
  CHECK(out.find("fused_rope/fused unified eager") != std::string::npos);
  const nlohmann::json j = read_json(json_path);
  CHECK(j["meta"]["kv_write"] == "unfused,fused,fused_rope");
  REQUIRE(j["cells"].size() == 2);
  for (const auto& c : j["cells"]) {
    std::set<std::string> names, writes;
    for (const auto& v : c["variants"]) {
      names.insert(v["variant"].get<std::string>());
      writes.insert(v["kv_write"].get<std::string>());
      CHECK(v["step_ms"].get<double>() > 0);
    }
    CHECK(names ==
          std::set<std::string>{"unified/eager/unfused", "unified/eager/fused", "unified/eager/fused_rope"});
    CHECK(writes == std::set<std::string>{"unfused", "fused", "fused_rope"});
    CHECK(c["comparisons"].contains("unfused/fused unified eager"));
    CHECK(c["comparisons"].contains("fused_rope/fused unified eager"));
  }

  // One path: the engine's write, the variants named as without the option.
  std::tie(rc, out) = run(std::string(KVFUSE_BENCH_ENGINE_BIN) +
                          " --set device=cpu --batch 1 --context 32 --attention unified --graphs off "
                          "--kv-write fused_rope --steps 1 --reps 3 --warmup 0 --json " +
                          json_path.string());
  INFO(out);
  REQUIRE(rc == 0);
  const nlohmann::json one = read_json(json_path);
  CHECK(one["meta"]["kv_write"] == "fused_rope");
  CHECK(one["meta"]["config"]["kv_write"] == "fused_rope");
  CHECK(one["cells"][0]["variants"][0]["variant"] == "unified/eager");

  // A name that is not a write path: the config key's message, with the allowed values.
  std::tie(rc, out) = run(std::string(KVFUSE_BENCH_ENGINE_BIN) + " --set device=cpu --kv-write fused,rope");
  CHECK(rc != 0);
  CHECK(out.find("--kv-write") != std::string::npos);
  CHECK(out.find("fused_rope") != std::string::npos);
}

TEST_CASE("kvfuse-bench-engine: cells beyond the KV budget or the model are skipped", "[bench][tools]") {
  TempDir dir;
  const std::filesystem::path json_path = dir / "out.json";
  // tiny: 1 KiB of fp8 KV per token; 4096 tokens do not fit 0.001 GiB, 8192 exceed its max position.
  auto [rc, out] = run(std::string(KVFUSE_BENCH_ENGINE_BIN) +
                       " --set device=cpu --batch 1 --context 32,4096,8192 --attention unified --graphs off "
                       "--steps 1 --reps 3 --warmup 0 --max-kv-gib 0.001 --json " +
                       json_path.string());
  INFO(out);
  REQUIRE(rc == 0);
  CHECK(out.find("skipped: needs") != std::string::npos);
  const nlohmann::json j = read_json(json_path);
  REQUIRE(j["cells"].size() == 1);
  CHECK(j["cells"][0]["context"] == 32);
  CHECK(j["cells"][0]["variants"].size() == 1);
  REQUIRE(j["skipped"].size() == 2);
  CHECK(j["skipped"][0]["context"] == 4096);
  CHECK(j["skipped"][0]["reason"].get<std::string>().find("needs") != std::string::npos);
  CHECK(j["skipped"][1]["context"] == 8192);
  CHECK(j["skipped"][1]["reason"].get<std::string>().find("max position") != std::string::npos);
}

TEST_CASE("bench/common: peak bandwidth from the table by device name, else the bus", "[bench]") {
  const auto peak = [](const char* name) {
    const auto e = lookup_peak(name);
    return e ? e->gbs : 0.0;
  };
  CHECK(peak("NVIDIA H200") == 4800);
  CHECK(peak("NVIDIA H200 NVL") == 4800);
  CHECK(peak("NVIDIA H20") == 4000);  // not the H200's entry
  CHECK(peak("NVIDIA H100 80GB HBM3") == 3350);
  CHECK(peak("NVIDIA H100 PCIe") == 2000);
  CHECK(peak("NVIDIA A100-SXM4-80GB") == 2039);
  CHECK(peak("NVIDIA A100-SXM4-40GB") == 1555);
  CHECK(peak("NVIDIA L40S") == 864);
  CHECK(peak("AMD Instinct MI300X") == 5300);
  CHECK(peak("AMD Instinct MI300X VF") == 5300);
  CHECK(peak("AMD Instinct MI325X") == 6000);
  CHECK(peak("AMD Instinct MI355X") == 8000);
  CHECK(peak("AMD Instinct MI300A") == 5300);
  CHECK(peak("AMD Instinct MI250X/MI250") == 3277);
  CHECK(peak("cuda NVIDIA H100 PCIe (sm_90, 79 GiB)") == 2000);  // a backend's description
  CHECK(peak("NVIDIA GeForce RTX 4090") == 0);

  PeakBandwidth p = resolve_peak("NVIDIA H200", 6144, 3201000, std::nullopt);
  CHECK(p.gbs == 4800);
  CHECK(p.source == "table: NVIDIA H200");
  // Not in the table: bus width x memory clock x 2.
  p = resolve_peak("NVIDIA GeForce RTX 4090", 384, 10501000, std::nullopt);
  CHECK(p.gbs == Approx(1008.096));
  CHECK(p.source.rfind("device: 384-bit bus", 0) == 0);
  p = resolve_peak("NVIDIA H200", 6144, 3201000, 4000.0);
  CHECK(p.gbs == 4000);
  CHECK(p.source == "--peak-gbs");
  CHECK(resolve_peak("unknown", 0, 0, std::nullopt).gbs == 0);
  p = resolve_peak_by_name("cpu (x86_64, 2 threads)", std::nullopt);
  CHECK(p.gbs == 4800);
  CHECK(p.source.rfind("reference: NVIDIA H200", 0) == 0);
  CHECK(resolve_peak_by_name("hip AMD Instinct MI300X (gfx942, 192 GiB)", std::nullopt).gbs == 5300);
}

TEST_CASE("bench/common: the results file keeps the kernel benchmarks' layout", "[bench]") {
  CHECK(
      json_object({{"T", int64_t(65536)},
                   {"kernel", "fused fp8"},
                   {"pdl", true},
                   {"us_per_call", Fixed{1.23456, 4}},
                   {"bytes", Fixed{3.0e9, 0}},
                   {"t", RawJson{"{}"}}}) ==
      R"({"T": 65536, "kernel": "fused fp8", "pdl": true, "us_per_call": 1.2346, "bytes": 3000000000, "t": {}})");
  CHECK(json_quote("a\"b\\") == R"("a\"b\\")");
  JsonResultsFile f;
  f.str("device", "NVIDIA H200 (132 SMs, L2 60 MB)");
  f.number("hbm_peak_gbs", {4800, 0});
  f.rows("results", {"{\"a\": 1}", "{\"a\": 2}"});
  f.rows("empty", {});
  f.raw("targets", "{}");
  CHECK(f.text() ==
        "{\n  \"device\": \"NVIDIA H200 (132 SMs, L2 60 MB)\",\n  \"hbm_peak_gbs\": 4800,\n  \"results\": [\n"
        "    {\"a\": 1},\n    {\"a\": 2}\n  ],\n  \"empty\": [\n  ],\n  \"targets\": {}\n}\n");

  DeviceInfo d;
  d.name = "AMD Instinct MI300X";
  d.hip = true;
  d.multiprocessors = 304;
  d.l2_bytes = int64_t(4) << 20;
  CHECK(device_label(d) == "AMD Instinct MI300X (304 CUs, L2 4 MB)");
  const std::string banner = device_banner(d, device_peak(d, std::nullopt));
  CHECK(banner.find("peak memory bandwidth: 5300 GB/s (table: AMD Instinct MI300X)") != std::string::npos);
}

namespace {
// parse_kernel_bench_args over "bench_x" and `words`.
std::optional<int> parse_bench_x(std::vector<std::string> words, const KernelBenchSpec& spec,
                                 KernelBenchArgs& a) {
  words.insert(words.begin(), "bench_x");
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  return parse_kernel_bench_args(int(argv.size()), argv.data(), spec, a);
}
}  // namespace

TEST_CASE("bench/common: kernel benchmark arguments", "[bench]") {
  const auto parse = [](std::vector<std::string> words, bool target_only, KernelBenchArgs& a) {
    return parse_bench_x(std::move(words), {"bench_x", 15, target_only}, a);
  };
  KernelBenchArgs a;
  CHECK(!parse({}, false, a).has_value());
  CHECK(a.rounds == 15);
  CHECK(a.json_path.empty());
  CHECK(!a.peak_gbs);
  CHECK(!parse({"--json", "out.json", "--rounds", "1", "--peak-gbs", "3350", "--target-only"}, true, a));
  CHECK(a.json_path == "out.json");
  CHECK(a.rounds == 3);  // at least 3
  CHECK(a.peak_gbs == 3350.0);
  CHECK(a.target_only);
  CHECK(std::string(program_name()) == "bench_x");
  CHECK(parse({"--target-only"}, false, a) == 2);
  CHECK(parse({"--peak-gbs", "-1"}, false, a) == 2);
  CHECK(parse({"--peak-gbs", "abc"}, false, a) == 2);
  CHECK(parse({"--bogus"}, false, a) == 2);
  CHECK(parse({"--batch", "64"}, false, a) == 2);  // no grid for this program
  CHECK(a.batches.empty());
}

TEST_CASE("bench/common: a kernel benchmark's grid from --batch and --context", "[bench]") {
  const auto parse = [](std::vector<std::string> words, KernelBenchArgs& a) {
    KernelBenchSpec spec{"bench_x", 7, false};
    spec.grid = true;
    return parse_bench_x(std::move(words), spec, a);
  };
  KernelBenchArgs a;
  CHECK(!parse({}, a).has_value());
  CHECK(a.batches.empty());
  CHECK(a.contexts.empty());
  CHECK(!parse({"--batch", "1,64", "--context", "16,2048,32768"}, a).has_value());
  CHECK(a.batches == std::vector<int>{1, 64});
  CHECK(a.contexts == std::vector<int>{16, 2048, 32768});
  for (const char* bad : {"", "0", "-4", "1,", ",1", "1,,2", "8x", "1.5", "99999999999"}) {
    CAPTURE(bad);
    CHECK(parse({"--context", bad}, a) == 2);
  }
  CHECK(parse({"--batch"}, a) == 2);  // no value
}

TEST_CASE("bench-engine plot: y ticks fit the data's range") {
  // Step / roofline ratios of a typical run (1.2 .. 1.8, the roofline at 1 in range).
  const std::vector<double> t = y_ticks(0.98, 1.85);
  REQUIRE(t.size() >= 3);
  CHECK(t.size() <= 8);
  CHECK(t.front() == 1.0);
  for (double v : t) CHECK((v >= 0.98 && v <= 1.85));
  // Several decades: coarse 1-2-5 ticks.
  const std::vector<double> wide = y_ticks(0.5, 300);
  CHECK(wide.size() <= 8);
  CHECK(wide.size() >= 3);
  CHECK(std::find(wide.begin(), wide.end(), 100.0) != wide.end());
  // A narrow range still gets at least one tick.
  CHECK(!y_ticks(1.0, 1.06).empty());
}

// --tp-rank-alone: rank 0 of a tensor_parallel group times its own shard on one device; the
// collectives are left out, so no collectives table, and the banner says what was timed.
TEST_CASE("kvfuse-bench-engine: --tp-rank-alone times rank 0's shard alone", "[bench][tools][tp]") {
  TempDir dir;
  const std::filesystem::path json_path = dir / "out.json";
  const std::string base = std::string(KVFUSE_BENCH_ENGINE_BIN) +
                           " --set device=cpu --set model=tiny --batch 1,2 --context 32 --attention split "
                           "--graphs off --steps 1 --reps 3 --warmup 0";
  auto [rc, out] = run(base + " --set tensor_parallel=2 --tp-rank-alone --json " + json_path.string());
  INFO(out);
  REQUIRE(rc == 0);
  CHECK(out.find("tensor_parallel 2, rank 0 alone (--tp-rank-alone)") != std::string::npos);
  CHECK(out.find("collectives ms") == std::string::npos);
  const nlohmann::json j = read_json(json_path);
  CHECK(j["meta"]["tensor_parallel"] == 2);
  CHECK(j["meta"]["tp_rank_alone"] == true);
  CHECK(j["meta"]["collectives"].get<std::string>().find("rank 0 of 2 alone") != std::string::npos);
  REQUIRE(j["cells"].size() == 2);
  for (const auto& c : j["cells"]) {
    CHECK_FALSE(c.contains("collectives_ms"));
    CHECK(c["variants"][0]["step_ms"].get<double>() > 0);
  }
  // The byte counts are rank 0's: half the tiny model's layer weights at tp 2.
  auto [rc1, out1] = run(base + " --json " + (dir / "one.json"));
  INFO(out1);
  REQUIRE(rc1 == 0);
  const nlohmann::json one = read_json(dir / "one.json");
  CHECK(j["meta"]["weight_bytes"].get<int64_t>() < one["meta"]["weight_bytes"].get<int64_t>());

  std::tie(rc, out) = run(base + " --tp-rank-alone");
  CHECK(rc != 0);
  CHECK(out.find("--tp-rank-alone needs tensor_parallel >= 2") != std::string::npos);
}
