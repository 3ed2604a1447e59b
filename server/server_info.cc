#include "server/server_info.h"

#include "kernels/common/kv_types.h"

namespace kvfuse::server {

void ServerInfo::build(Engine& engine, const Config& cfg, const ServiceLimits& base) {
  limits_ = base;
  limits_.vocab = engine.spec().vocab;
  limits_.max_seq_len = cfg.max_seq_len;
  const ModelSpec& spec = engine.spec();
  info_.set_model(spec.name);
  info_.set_arch(spec.arch);
  info_.set_vocab_size(uint32_t(spec.vocab));
  info_.set_num_layers(uint32_t(spec.num_layers));
  info_.set_kv_cache_dtype(to_string(cfg.kv_cache_dtype));
  info_.set_kv_format(kv_format_name(engine.kv_format()));
  info_.set_page_size(uint32_t(cfg.page_size));
  info_.set_num_pages(uint64_t(engine.pool().usage(PoolKind::full).total_pages));
  if (engine.pool().has_swa()) {
    info_.set_swa_num_pages(uint64_t(engine.pool().usage(PoolKind::swa).total_pages));
    info_.set_sliding_window(uint32_t(engine.pool().config().window));
  }
  info_.set_attention(to_string(cfg.attention));
  info_.set_kv_write(to_string(cfg.kv_write));
  info_.set_device(engine.backend().description());
  info_.set_version(KVFUSE_VERSION);
  info_.set_max_seq_len(uint32_t(cfg.max_seq_len));
  for (int32_t id : spec.eos_token_ids) info_.add_eos_token_ids(id);
  if (spec.bos_token_id >= 0) info_.set_bos_token_id(spec.bos_token_id);
  if (spec.pad_token_id >= 0) info_.set_pad_token_id(spec.pad_token_id);
  info_.set_max_position(uint32_t(spec.max_position));
  info_.set_tensor_parallel(uint32_t(engine.num_ranks()));
  info_.set_weight_format(spec.weight_format());
  info_.set_weight_bytes(uint64_t(spec.weight_bytes()));
  if (engine.num_ranks() == 1) {
    const MemorySplit& m = engine.memory();
    v1::MemorySplit* out = info_.mutable_memory();
    out->set_weight_bytes(uint64_t(m.weight_bytes));
    out->set_kv_pool_bytes(uint64_t(m.kv_pool_bytes));
    out->set_workspace_bytes(uint64_t(m.workspace_bytes));
    out->set_graph_bytes(uint64_t(m.graph_bytes));
    out->set_device_total_bytes(uint64_t(m.device_total_bytes));
    out->set_device_free_bytes(uint64_t(m.device_free_bytes));
    out->set_headroom_bytes(uint64_t(m.headroom_bytes));
    out->set_pool_sized_to_fit(m.pool_auto);
  }
  info_.set_max_batch_tokens(uint32_t(cfg.max_batch_tokens));
  info_.set_max_running_seqs(uint32_t(cfg.max_running_seqs));
  info_.set_max_decode_steps(uint32_t(limits_.max_decode_steps));
  info_.set_max_batch_sequences(uint32_t(limits_.max_batch_sequences));
  for (float k : engine.pool().config().k_scale) info_.add_k_scale(k);
  for (float v : engine.pool().config().v_scale) info_.add_v_scale(v);
  metrics_.set_info({{"model", info_.model()},
                     {"device", info_.device()},
                     {"kv_cache_dtype", info_.kv_cache_dtype()},
                     {"kv_format", info_.kv_format()},
                     {"kv_write", info_.kv_write()},
                     {"attention", info_.attention()},
                     {"version", info_.version()}});
}

void ServerInfo::fill_load(const LoopWork& work, bool serving, v1::GetLoadResponse* resp) const {
  const Scheduler& sched = *work.sched;
  const KvPool& pool = work.engine->pool();
  resp->set_num_running(uint32_t(sched.num_running() + sched.num_router_sequences()));
  resp->set_num_waiting(uint32_t(sched.num_waiting()));
  for (PoolKind kind : {PoolKind::full, PoolKind::swa}) {
    if (kind == PoolKind::swa && !pool.has_swa()) continue;
    const PoolUsage u = pool.usage(kind);
    v1::PoolLoad* p = resp->add_pools();
    p->set_pool(kind == PoolKind::full ? "full" : "swa");
    p->set_total_pages(uint64_t(u.total_pages));
    p->set_used_pages(uint64_t(u.used_pages));
    p->set_free_pages(uint64_t(u.free_pages));
    p->set_shared_pages(uint64_t(u.shared_pages));
    if (kind == PoolKind::full) {
      const KvPool::CacheStats c = pool.cache_stats();
      p->set_cached_pages(uint64_t(c.cached_pages));
      p->set_evictable_pages(uint64_t(c.evictable_pages));
    }
  }
  const PoolUsage full = pool.usage(PoolKind::full);
  resp->set_kv_usage(full.total_pages > 0 ? double(full.used_pages) / double(full.total_pages) : 0.0);
  resp->set_num_router_sequences(uint32_t(sched.num_router_sequences()));
  resp->set_num_streams(uint32_t(work.streams.size()));
  resp->set_serving(serving);
}

void ServerInfo::publish_load(const LoopWork& work) {
  if (!work.started()) {
    in_flight_ = 0;
    return;
  }
  const Scheduler& sched = *work.sched;
  LoadGauges g;
  g.running = int64_t(sched.num_running() + sched.num_router_sequences());
  g.waiting = int64_t(sched.num_waiting());
  g.router_sequences = int64_t(sched.num_router_sequences());
  g.streams = int64_t(work.streams.size());
  const KvPool& pool = work.engine->pool();
  g.full_used = pool.usage(PoolKind::full).used_pages;
  g.full_total = pool.usage(PoolKind::full).total_pages;
  if (pool.has_swa()) {
    g.swa_used = pool.usage(PoolKind::swa).used_pages;
    g.swa_total = pool.usage(PoolKind::swa).total_pages;
  }
  g.preemptions = sched.num_preemptions();
  const KvPool::CacheStats c = pool.cache_stats();
  g.cache_query_tokens = c.query_tokens;
  g.cache_hit_tokens = c.hit_tokens;
  g.cached_pages = c.cached_pages;
  g.evictable_pages = c.evictable_pages;
  metrics_.set_load(g);
  in_flight_ = work.in_flight();
}

}  // namespace kvfuse::server
