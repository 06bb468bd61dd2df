"""DeepSeek-V4-Flash-shaped attention layers (random weights, torch kernels, bf16): the time of one decode step
per layer type (sliding, CSA, HCA) as the context grows (4k..128k); `python -m benchmarks.v4_decode_step [batch]`
on a GPU. The step must grow with the entries it selects, not with the context."""
import sys, time, torch
from engine import kernels
from engine.forward_context import forward_context
from engine.kernels.attention import CommonAttentionMetadata
from engine.kv_cache_spec import CacheGroupMetadata, PagedSpec
from engine.layers.deepseek_v4 import DeepseekV4Attention
dev = torch.device("cuda")
kernels.activate("torch", dev)
torch.set_default_dtype(torch.bfloat16)
from types import SimpleNamespace
cfg = SimpleNamespace(hidden_size=4096, num_attention_heads=64, head_dim=512, q_lora_rank=1024, partial_rotary_factor=0.125,
    sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512, rms_norm_eps=1e-6,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0}, "compress": {"rope_type": "default", "rope_theta": 160000.0}})
B, BS = int(sys.argv[1]) if len(sys.argv) > 1 else 4, 64
for lt_i, lt in enumerate(cfg.layer_types):
    with torch.device(dev):
        layer = DeepseekV4Attention(cfg, lt_i)
    for p in layer.parameters():
        if p.is_floating_point(): p.data.normal_(0, 0.02)
    for L in (4096, 16384, 65536, 131072):
        specs = layer.cache_specs()
        caches, groups = {}, {}
        for name, spec in specs.items():
            if isinstance(spec, PagedSpec):
                per_seq = -(-(L + 1) // spec.ratio // BS) + 1
                caches[name] = torch.randn(spec.shape(B * per_seq, BS), device=dev)
                table = torch.arange(B * per_seq, device=dev, dtype=torch.int32).view(B, per_seq)
                e = torch.full((B,), L // spec.ratio, device=dev)
                slots = (table[torch.arange(B, device=dev), e // BS].long() * BS + e % BS)
                groups[spec.group] = CacheGroupMetadata(spec.ratio, spec.window, BS, table, slots, table.cpu().numpy())
            else:
                caches[name] = torch.randn(B, *spec.shape, device=dev)
        layer.bind_caches(caches)
        g = groups[(1, 128)]
        md = CommonAttentionMetadata(num_seqs=B, num_decodes=B, num_tokens=B,
            query_start_loc=torch.arange(B + 1, device=dev, dtype=torch.int32),
            seq_lens=torch.full((B,), L + 1, device=dev, dtype=torch.int32), block_table=g.block_table,
            slot_mapping=g.slot_mapping, max_query_len=1, max_seq_len=L + 1, query_start_loc_cpu=list(range(B + 1)),
            seq_lens_cpu=[L + 1] * B, num_computed_tokens_cpu=[L] * B, groups=groups,
            state_slots=torch.arange(B, device=dev), state_slots_cpu=list(range(B)))
        x, pos = torch.randn(B, cfg.hidden_size, device=dev), torch.full((B,), L, device=dev)
        times = []
        with torch.inference_mode(), forward_context(md, BS):
            for i in range(25):
                torch.cuda.synchronize(); t = time.perf_counter(); layer(pos, x); torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
        times.sort()
        print(f"{lt:32s} batch {B} context {L:7d}: {1e3 * times[len(times) // 2]:.2f} ms", flush=True)
        del caches, groups; layer.bind_caches({}); torch.cuda.empty_cache()
