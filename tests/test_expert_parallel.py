"""Expert parallelism on CPU: gloo process groups of 2 and 4 ranks spawned on 127.0.0.1.

Each rank holds its own tokens and its shard of the experts; its output must equal, bit for bit, the
rows of the single-device layer (moe_forward_reference over all ranks' tokens, same routing), and stay
within 2x the single-device error of an fp64 per-token reference. Capacity drops are checked against
moe_reference with the dropped slots removed.
"""
from __future__ import annotations

import dataclasses
import datetime
import socket

import pytest
import torch

from moe2cta import Activation, RouterWeightOn, RoutingConfig, Scoring, moe_forward_reference, moe_reference
from moe2cta.expert_parallel import (
    A2AMode,
    ExpertParallelConfig,
    ExpertPlacement,
    capacity_per_peer_for,
    ep_combine,
    ep_dispatch,
    ep_expert_compute,
    ep_fused_moe,
    expert_map_for,
    expert_owner_and_local_id,
    local_expert_ids,
    send_layout_for,
    shard_experts,
)
from moe2cta.router.reference import dispatch_reference, route_reference

SOFTMAX_K2 = RoutingConfig(top_k=2)
DEEPSEEK_LIKE = RoutingConfig(
    top_k=4, scoring=Scoring.SIGMOID_GROUPED, num_expert_group=4, topk_group=2, routed_scaling_factor=2.5
)
LLAMA4_LIKE = RoutingConfig(top_k=1, scoring=Scoring.SIGMOID_TOP1)
GPT_OSS_LIKE = RoutingConfig(top_k=2, scoring=Scoring.TOPK_SOFTMAX)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    tokens_per_rank: tuple  # T of each rank (the world size is its length)
    num_experts: int = 8
    routing: RoutingConfig = SOFTMAX_K2
    placement: ExpertPlacement = ExpertPlacement.CONTIGUOUS
    a2a_mode: A2AMode = A2AMode.EXACT_SPLITS
    capacity_per_peer: int | None = None
    activation: Activation = Activation.SWIGLU
    router_weight_on: RouterWeightOn = RouterWeightOn.OUTPUT
    bias: bool = False
    correction_bias: bool = False
    dtype: torch.dtype = torch.float32
    target_rank: int | None = None  # route every token to this rank's experts only
    avoid_rank: int | None = None  # route no token to this rank's experts
    hidden: int = 32
    intermediate: int = 16
    seed: int = 0


def _make_data(case: Case):
    """The whole problem, identical on every rank (same generator seed)."""
    gen = torch.Generator().manual_seed(1234 + case.seed)
    total = sum(case.tokens_per_rank)
    E, H, I = case.num_experts, case.hidden, case.intermediate
    hidden = torch.randn(total, H, generator=gen).to(case.dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(case.dtype)
    w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).to(case.dtype)
    logits = torch.randn(total, E, generator=gen)
    b13 = (0.1 * torch.randn(E, 2 * I, generator=gen)).to(case.dtype) if case.bias else None
    b2 = (0.1 * torch.randn(E, H, generator=gen)).to(case.dtype) if case.bias else None
    corr = 0.1 * torch.randn(E, generator=gen) if case.correction_bias else None
    world = len(case.tokens_per_rank)
    for r, keep in ((case.target_rank, True), (case.avoid_rank, False)):
        if r is None:
            continue
        owned = torch.zeros(E, dtype=torch.bool)
        owned[local_expert_ids(r, world, E, case.placement)] = True
        penalized = ~owned if keep else owned
        logits[:, penalized] -= 40.0
        if corr is not None:
            corr[penalized] -= 40.0
    return hidden, w13, w2, logits, b13, b2, corr


def _dropped_ids(topk_ids: torch.Tensor, cfg: ExpertParallelConfig, capacity: int) -> torch.Tensor:
    """topk_ids with -1 for the slots PADDED_CAPACITY drops: per destination, slots past `capacity`."""
    owner, _ = expert_owner_and_local_id(topk_ids, cfg.world_size, cfg.num_global_experts, cfg.placement)
    flat = owner.reshape(-1)
    kept = topk_ids.clone().reshape(-1)
    seen = [0] * cfg.world_size
    for s, d in enumerate(flat.tolist()):
        if seen[d] >= capacity:
            kept[s] = -1
        seen[d] += 1
    return kept.view_as(topk_ids)


def _check_case(rank: int, case: Case, device: str = "cpu", group=None) -> None:
    world = len(case.tokens_per_rank)
    cfg = ExpertParallelConfig(
        world, rank, case.num_experts, case.placement, case.a2a_mode, case.capacity_per_peer
    )
    data = _make_data(case)
    hidden_all, w13, w2, logits_all, b13, b2, corr = (None if t is None else t.to(device) for t in data)
    start = sum(case.tokens_per_rank[:rank])
    rows = slice(start, start + case.tokens_per_rank[rank])
    hidden, logits = hidden_all[rows], logits_all[rows]
    common = dict(activation=case.activation, router_weight_on=case.router_weight_on)
    out = ep_fused_moe(
        hidden,
        shard_experts(w13, cfg),
        shard_experts(w2, cfg),
        logits,
        case.routing,
        cfg,
        group,
        b13_local=shard_experts(b13, cfg),
        b2_local=shard_experts(b2, cfg),
        e_score_correction_bias=corr,
        **common,
    )
    assert out.dtype == case.dtype and out.shape == hidden.shape, case.name
    weights, ids = route_reference(logits, case.routing, corr)
    capacity = case.capacity_per_peer
    drops = capacity is not None and capacity < max(case.tokens_per_rank) * case.routing.top_k
    if drops:
        ids = _dropped_ids(ids, cfg, capacity)
    else:
        # The single-device layer on the same routing: every rank routes its own tokens, and torch's CPU sigmoid
        # and reductions may move a score by an ulp with the batch size (vector vs scalar paths; seen on an
        # AVX-512 host), so the single-device layer takes the per-rank routing rather than routing all tokens at once.
        per_rank = [route_reference(logits_all[sum(case.tokens_per_rank[:r]): sum(case.tokens_per_rank[:r + 1])],
                                    case.routing, corr) for r in range(world)]
        single = moe_forward_reference(
            hidden_all, w13, w2, None, case.routing, topk_weights=torch.cat([w for w, _ in per_rank]),
            topk_ids=torch.cat([i for _, i in per_rank]), b13=b13, b2=b2, **common
        )[rows]
        assert torch.equal(out, single), f"{case.name} rank {rank}: differs from the single-device layer"
    exact = moe_reference(hidden, w13, w2, weights, ids, b13=b13, b2=b2, dtype=torch.float64, **common)
    same_dtype = moe_reference(hidden, w13, w2, weights, ids, b13=b13, b2=b2, dtype=case.dtype, **common)
    if out.numel() == 0:  # a rank without tokens still takes part in both exchanges
        return
    tol = 2 * (same_dtype.double() - exact).abs().max().item() + 1e-6
    err = (out.double() - exact).abs().max().item()
    assert err <= tol, f"{case.name} rank {rank}: max error {err} > {tol}"


def _check_phases_report_drops(rank: int, world: int, device: str, group=None) -> None:
    """The phase API and num_dropped: capacity 2 rows per peer with every token sent to rank 0."""
    case = Case("drops", (6,) * world, target_rank=0, a2a_mode=A2AMode.PADDED_CAPACITY, capacity_per_peer=2)
    cfg = ExpertParallelConfig(world, rank, case.num_experts, a2a_mode=A2AMode.PADDED_CAPACITY, capacity_per_peer=2)
    hidden_all, w13, w2, logits_all = (t.to(device) for t in _make_data(case)[:4])
    hidden = hidden_all[6 * rank : 6 * rank + 6]
    weights, ids = route_reference(logits_all[6 * rank : 6 * rank + 6], case.routing)
    sent = ep_dispatch(hidden, weights, ids, cfg, group)
    assert int(sent.num_dropped) == 6 * 2 - 2  # 12 slots to rank 0, 2 fit
    assert sent.recv_rows.shape[0] == world * 2
    y = ep_expert_compute(sent, shard_experts(w13, cfg), shard_experts(w2, cfg))
    out = ep_combine(y, sent, cfg, group)
    kept = _dropped_ids(ids, cfg, 2)
    exact = moe_reference(hidden, w13, w2, weights, kept, dtype=torch.float64)
    assert (out.double() - exact).abs().max().item() < 1e-5


def _check_off_rank_ids(rank: int, world: int, device: str, group=None) -> None:
    """The phase API with ids no rank owns (-1, E, past int32) in both modes: those slots go nowhere and add zero, as
    in the single-device dispatch; num_dropped does not count them."""
    case = Case("off-rank", (5,) * world, seed=14)
    hidden_all, w13, w2, logits_all = (t.to(device) for t in _make_data(case)[:4])
    hidden = hidden_all[5 * rank : 5 * rank + 5]
    weights, ids = route_reference(logits_all[5 * rank : 5 * rank + 5], case.routing)
    ids = ids.long()
    ids[0, 0], ids[2, 1], ids[4, 0] = -1, case.num_experts, 2**40
    exact = moe_reference(hidden, w13, w2, weights, torch.where(ids.ge(case.num_experts), -1, ids), dtype=torch.float64)
    for mode in A2AMode:
        cfg = ExpertParallelConfig(world, rank, case.num_experts, a2a_mode=mode)
        sent = ep_dispatch(hidden, weights, ids, cfg, group)
        assert int(sent.num_dropped) == 0, mode
        y = ep_expert_compute(sent, shard_experts(w13, cfg), shard_experts(w2, cfg))
        out = ep_combine(y, sent, cfg, group)
        assert (out.double() - exact).abs().max().item() < 1e-5, mode


def _check_group_mismatch(rank: int, world: int, group=None) -> None:
    wrong = ExpertParallelConfig(world, (rank + 1) % world, 8)
    h = torch.randn(3, 32)
    with pytest.raises(ValueError, match="group has"):
        ep_fused_moe(h, torch.randn(wrong.num_local_experts, 32, 32), torch.randn(wrong.num_local_experts, 32, 16),
                     torch.randn(3, 8), SOFTMAX_K2, wrong, group)


def _worker(rank: int, world: int, port: int, cases_by_world: dict, backend: str = "gloo") -> None:
    """Run cases_by_world[world] on the whole group and, when world == 4, cases_by_world[2] on two
    concurrent 2-rank subgroups {0, 1} and {2, 3} (one spawn covers both sizes and non-default groups)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # a deadlock fails instead of hanging
    try:
        runs = [(None, rank, world, 0)]
        if world == 4 and 2 in cases_by_world:
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
            runs.insert(0, (pairs[rank // 2], rank % 2, 2, rank // 2))
        for group, group_rank, size, variant in runs:
            for case in cases_by_world.get(size, []):
                _check_case(group_rank, dataclasses.replace(case, seed=case.seed + 100 * variant), device, group)
            _check_phases_report_drops(group_rank, size, device, group)
            _check_off_rank_ids(group_rank, size, device, group)
            _check_group_mismatch(group_rank, size, group)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cases(world: int) -> list:
    P, M = ExpertPlacement, A2AMode
    even = (5,) * world
    uneven = tuple(3 + 2 * r for r in range(world))
    with_empty = (0,) + tuple(4 + r for r in range(world - 1))
    cases = [
        Case("softmax-contiguous-exact", uneven),
        Case("softmax-roundrobin-padded", even, placement=P.ROUND_ROBIN, a2a_mode=M.PADDED_CAPACITY, seed=1),
        Case("deepseek-like-grouped-bias", uneven, num_experts=16, routing=DEEPSEEK_LIKE, correction_bias=True,
             placement=P.ROUND_ROBIN, seed=2),
        Case("deepseek-like-padded", even, num_experts=16, routing=DEEPSEEK_LIKE, correction_bias=True,
             a2a_mode=M.PADDED_CAPACITY, seed=3),
        Case("llama4-like-input-weight", uneven, routing=LLAMA4_LIKE, router_weight_on=RouterWeightOn.INPUT, seed=4),
        Case("gpt-oss-like-bias", even, routing=GPT_OSS_LIKE, activation=Activation.SWIGLU_OAI, bias=True,
             a2a_mode=M.PADDED_CAPACITY, seed=5),
        Case("all-tokens-to-rank0-experts", uneven, target_rank=0, seed=6),
        Case("all-tokens-to-last-rank-padded", even, target_rank=world - 1, a2a_mode=M.PADDED_CAPACITY, seed=7),
        Case("no-tokens-to-rank1-experts", uneven, avoid_rank=1, placement=P.ROUND_ROBIN, seed=8),
        Case("rank0-has-no-tokens-exact", with_empty, seed=9),
        Case("rank0-has-no-tokens-padded", with_empty, a2a_mode=M.PADDED_CAPACITY,
             capacity_per_peer=max(with_empty) * 2, seed=10),
        Case("experts-not-divisible", uneven, num_experts=2 * world + 1, placement=P.CONTIGUOUS, seed=11),
        Case("bf16", uneven, dtype=torch.bfloat16, placement=P.ROUND_ROBIN, seed=12),
        Case("capacity-drops", even, target_rank=0, a2a_mode=M.PADDED_CAPACITY, capacity_per_peer=3, seed=13),
    ]
    return cases


def test_expert_parallel_matches_single_device_2_and_4_ranks():
    import torch.multiprocessing as mp

    cases = {2: _cases(2), 4: _cases(4)}
    mp.start_processes(_worker, args=(4, _free_port(), cases), nprocs=4, join=True, start_method="spawn")


@pytest.mark.gpu
def test_expert_parallel_nccl_two_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (NCCL all-to-all)")
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(2, _free_port(), {2: _cases(2)}, "nccl"), nprocs=2, join=True,
                       start_method="spawn")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(A2AMode))
def test_single_rank_on_gpu(mode):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _check_case(0, Case("one-rank-gpu", (33,), num_experts=16, routing=DEEPSEEK_LIKE, correction_bias=True,
                         a2a_mode=mode, dtype=torch.bfloat16), "cuda")


def test_ep_bench_cpu_smoke(tmp_path):
    from moe2cta.serving_bench import ep_bench

    out = tmp_path / "ep.json"
    assert ep_bench.main(["--smoke", "--model", "qwen3-235b-a22b", "--mode", "padded_capacity", "--json", str(out)]) == 0
    import json

    (result,) = json.loads(out.read_text())
    assert result["equals_single_device"] == [True, True]
    assert result["rows_sent_per_rank_median"] == [2 * 16 * 8] * 2  # W * C rows, C = T*k
    assert result["local_experts"] == 64


# ---- in-process tests (no process group) ----


@pytest.mark.parametrize("placement", list(ExpertPlacement))
@pytest.mark.parametrize("world,experts", [(1, 4), (2, 8), (3, 8), (4, 6), (4, 256)])
def test_expert_maps_partition_the_experts(placement, world, experts):
    seen = []
    for rank in range(world):
        ids = local_expert_ids(rank, world, experts, placement)
        emap = expert_map_for(rank, world, experts, placement)
        assert emap.dtype == torch.int32 and emap.shape == (experts,)
        assert [int(emap[e]) for e in ids] == list(range(len(ids)))
        assert int((emap >= 0).sum()) == len(ids)
        assert len(ids) in (experts // world, -(-experts // world))
        assert ExpertParallelConfig(world, rank, experts, placement).num_local_experts == len(ids)
        seen += ids
    assert sorted(seen) == list(range(experts))
    if placement is ExpertPlacement.ROUND_ROBIN:
        assert local_expert_ids(world - 1, world, experts, placement)[0] == world - 1
    else:
        assert local_expert_ids(0, world, experts, placement)[0] == 0


@pytest.mark.parametrize("mode", list(A2AMode))
def test_single_rank_equals_single_device(mode):
    case = Case("one-rank", (9,), routing=DEEPSEEK_LIKE, num_experts=16, correction_bias=True, a2a_mode=mode)
    _check_case(0, case)


def test_single_rank_capacity_drop():
    case = Case("one-rank-drop", (9,), a2a_mode=A2AMode.PADDED_CAPACITY, capacity_per_peer=5)
    _check_case(0, case)


def test_single_rank_off_rank_ids():
    _check_off_rank_ids(0, 1, "cpu")


def test_config_and_input_errors():
    with pytest.raises(ValueError, match="rank"):
        ExpertParallelConfig(2, 2, 8)
    with pytest.raises(ValueError, match="num_global_experts"):
        ExpertParallelConfig(4, 0, 3)
    with pytest.raises(ValueError, match="capacity_per_peer"):
        ExpertParallelConfig(2, 0, 8, capacity_per_peer=4)
    with pytest.raises(ValueError, match="capacity_per_peer"):
        ExpertParallelConfig(2, 0, 8, a2a_mode="padded_capacity", capacity_per_peer=0)
    with pytest.raises(ValueError, match="placement"):
        ExpertParallelConfig(2, 0, 8, placement="striped")
    assert ExpertParallelConfig(2, 0, 8, placement="round_robin").placement is ExpertPlacement.ROUND_ROBIN
    cfg = ExpertParallelConfig(1, 0, 8)
    h = torch.randn(3, 32)
    w13, w2 = torch.randn(8, 32, 32), torch.randn(8, 32, 16)
    with pytest.raises(ValueError, match="w13_local"):
        ep_fused_moe(h, w13[:4], w2, torch.randn(3, 8), SOFTMAX_K2, cfg)
    with pytest.raises(ValueError, match="router_logits"):
        ep_fused_moe(h, w13, w2, torch.randn(3, 7), SOFTMAX_K2, cfg)
    with pytest.raises(TypeError, match="w2_local"):
        ep_fused_moe(h, w13, w2.double(), torch.randn(3, 8), SOFTMAX_K2, cfg)
    with pytest.raises(ValueError, match="not initialized"):
        two = ExpertParallelConfig(2, 0, 8)
        ep_fused_moe(h, w13[:4], w2[:4], torch.randn(3, 8), SOFTMAX_K2, two)
    with pytest.raises(ValueError, match="num_global_experts"):
        shard_experts(w13[:5], cfg)
    # the same checks as fused_moe, each naming its argument
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    weights = torch.rand(3, 2)
    for call, error, name in [
        (lambda: ep_fused_moe(h, w13, w2, torch.randn(3, 8), None, cfg), TypeError, "routing"),
        (lambda: ep_fused_moe(h, [1], w2, torch.randn(3, 8), SOFTMAX_K2, cfg), TypeError, "w13_local"),
        (lambda: ep_fused_moe(h.int(), w13, w2, torch.randn(3, 8), SOFTMAX_K2, cfg), TypeError, "hidden"),
        (lambda: ep_fused_moe(h.double(), w13.double(), w2.double(), torch.randn(3, 8), SOFTMAX_K2, cfg),
         TypeError, "w13_local"),
        (lambda: ep_fused_moe(h, w13, w2, torch.randn(3, 8).int(), SOFTMAX_K2, cfg), TypeError, "router_logits"),
        (lambda: ep_fused_moe(h, w13, w2, torch.randn(3, 8), SOFTMAX_K2, cfg,
                              e_score_correction_bias=torch.zeros(8)), ValueError, "e_score_correction_bias"),
        (lambda: ep_fused_moe(h, w13, w2, torch.randn(3, 8), SOFTMAX_K2, cfg,
                              b13_local=torch.zeros(8, 32, dtype=torch.int32)), TypeError, "b13_local"),
        (lambda: ep_fused_moe(h, w13, w2, None, SOFTMAX_K2, cfg, topk_weights=weights.int(), topk_ids=ids),
         TypeError, "topk_weights"),
        (lambda: ep_fused_moe(h, w13, w2, None, RoutingConfig(top_k=3), cfg, topk_weights=weights, topk_ids=ids),
         ValueError, "topk_ids"),
        (lambda: ep_fused_moe(h, w13, w2, None, SOFTMAX_K2, cfg, topk_weights=weights, topk_ids=ids + 3),
         ValueError, "topk_ids"),  # values past E_global, checked on the CPU
        (lambda: ep_fused_moe(h, w13, w2, None, SOFTMAX_K2, cfg, topk_weights=weights, topk_ids=ids - 1),
         ValueError, "topk_ids"),
        (lambda: ep_fused_moe(h, w13, w2, torch.randn(3, 8), SOFTMAX_K2, cfg, align=0), ValueError, "align"),
        (lambda: ep_fused_moe(h, w13, w2, torch.randn(3, 8), SOFTMAX_K2, cfg, router_weight_on="both"),
         ValueError, "router_weight_on"),
        (lambda: expert_map_for(0, 8, 4), ValueError, "num_global_experts"),
    ]:
        with pytest.raises(error, match=f"^{name}: "):
            call()
    # router_weight_on as a string acts as its enum member
    logits = torch.randn(3, 8)
    for on in RouterWeightOn:
        assert torch.equal(ep_fused_moe(h, w13, w2, logits, SOFTMAX_K2, cfg, router_weight_on=on.value),
                           ep_fused_moe(h, w13, w2, logits, SOFTMAX_K2, cfg, router_weight_on=on))


def test_send_layout_matches_router_dispatch_over_ranks():
    gen = torch.Generator().manual_seed(3)
    dest = torch.randint(0, 4, (37, 3), generator=gen, dtype=torch.int32)
    dest[5:9] = 2  # a crowded destination
    exact = send_layout_for(dest, 4)
    ref = dispatch_reference(dest, 4, align=1)
    for field in ("counts", "token_offsets", "row_offsets", "sorted_slots", "slot_rows"):
        assert torch.equal(getattr(exact, field), getattr(ref, field)), field
    padded = send_layout_for(dest, 4, capacity=9)
    assert torch.equal(padded.counts, ref.counts.clamp(max=9))
    assert torch.equal(padded.row_offsets, torch.arange(5, dtype=torch.int32) * 9)
    position = ref.slot_rows.long() - ref.token_offsets.long()[dest.reshape(-1).long()]
    expected = torch.where(position < 9, dest.reshape(-1).long() * 9 + position, torch.full_like(position, -1))
    assert torch.equal(padded.slot_rows.long(), expected)
    kept = padded.slot_rows >= 0
    assert torch.equal(padded.sorted_slots.long()[padded.slot_rows.long()[kept]], torch.arange(111)[kept])
    assert int((padded.sorted_slots >= 0).sum()) == int(kept.sum())
    empty = send_layout_for(torch.zeros(0, 2, dtype=torch.int32), 3, capacity=4)
    assert empty.sorted_slots.shape == (12,) and bool((empty.sorted_slots == -1).all())


def test_capacity_per_peer_for():
    assert capacity_per_peer_for(128, 8, 2) == 512
    assert capacity_per_peer_for(128, 8, 2, 1.25) == 640
    assert capacity_per_peer_for(100, 8, 3) == 267
    assert capacity_per_peer_for(128, 8, 2, 4.0) == 1024  # never more than T*k
    assert capacity_per_peer_for(0, 8, 2) == 1
    with pytest.raises(ValueError, match="capacity_factor"):
        capacity_per_peer_for(8, 2, 2, 0.0)


def test_capacity_and_rank_helpers_check_their_arguments():
    assert capacity_per_peer_for(8, 2, 4) == 4 and capacity_per_peer_for(8, 2, 4, float("inf")) == 16
    assert capacity_per_peer_for(0, 2, 4) == 1
    for args, named in (((-5, 2, 4), "num_tokens"), ((4.5, 2, 4), "num_tokens"), ((8, 0, 4), "top_k"),
                        ((8, 2, 0), "world_size"), ((8, 2, 4, "2"), "capacity_factor"),
                        ((8, 2, 4, float("nan")), "capacity_factor")):
        with pytest.raises(ValueError, match=f"^{named}: expected"):
            capacity_per_peer_for(*args)
    for rank in (5, -1, 2):
        with pytest.raises(ValueError, match="rank: expected an int in"):
            local_expert_ids(rank, 2, 8)


def test_phase_functions_check_their_inputs():
    """ep_dispatch / ep_expert_compute / ep_combine called directly (one rank): mismatched shapes, float ids, weights
    for the wrong number of local experts and a short y_recv are named, not run."""
    cfg = ExpertParallelConfig(world_size=1, rank=0, num_global_experts=4)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(4, 16, generator=gen)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]], dtype=torch.int32)
    weights = torch.rand(4, 2, generator=gen)
    with pytest.raises(ValueError, match="topk_weights: expected shape"):
        ep_dispatch(hidden, torch.rand(4, 3), ids, cfg)
    with pytest.raises(TypeError, match="topk_ids"):
        ep_dispatch(hidden, weights, ids.float(), cfg)
    with pytest.raises(ValueError, match="topk_ids: expected 5 rows"):
        ep_dispatch(torch.randn(5, 16), weights, ids, cfg)
    with pytest.raises(TypeError, match="ep_config"):
        ep_dispatch(hidden, weights, ids, None)
    dispatched = ep_dispatch(hidden, weights, ids, cfg)
    w13, w2 = torch.randn(4, 2 * 8, 16, generator=gen), torch.randn(4, 16, 8, generator=gen)
    with pytest.raises(ValueError, match="w13_local: expected this rank's 4 experts"):
        ep_expert_compute(dispatched, w13[:2], w2[:2])
    with pytest.raises(ValueError, match="w2_local: expected shape"):
        ep_expert_compute(dispatched, w13, w2[:, :, :4])
    with pytest.raises(TypeError, match="w13_local: expected dtype torch.float32 \\(the dtype of the received rows"):
        ep_expert_compute(dispatched, w13.half(), w2.half())
    with pytest.raises(TypeError, match="w13_local: expected dtype in"):
        ep_expert_compute(dispatched, w13.int(), w2.int())
    with pytest.raises(ValueError, match="b13_local: expected shape"):
        ep_expert_compute(dispatched, w13, w2, b13_local=torch.zeros(4, 8))
    with pytest.raises(ValueError, match="align: expected an int >= 1"):
        ep_expert_compute(dispatched, w13, w2, align=0)
    y = ep_expert_compute(dispatched, w13, w2)
    with pytest.raises(ValueError, match="y_recv: expected 8 rows"):
        ep_combine(y[:5], dispatched, cfg)
    with pytest.raises(TypeError, match="out_dtype: expected one of"):
        ep_combine(y, dispatched, cfg, out_dtype=torch.int32)
    out = ep_combine(y, dispatched, cfg)
    want = moe_reference(hidden, w13, w2, weights, ids, dtype=torch.float64)
    assert (out.double() - want).abs().max() <= 1e-4 * want.abs().max()
