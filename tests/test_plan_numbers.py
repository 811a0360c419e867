"""Every worked example of the guide, through the public Python API.

The expected values are the guide's own figures, written here as the guide prints them; the code
derives its values from the hardware and model presets and the formulas.
"""

import pytest

import zerodp.plan as plan

GB = 1e9


@pytest.mark.parametrize("stage, seed_gb, digits", [(0, 120, 0), (1, 31.4, 1), (2, 16.6, 1), (3, 1.88, 2)])
def test_zero_paper_table(stage, seed_gb, digits):
    # guide §9.4: Ψ = 7.5B, k = 12, N = 64 -> 120 / 31.4 / 16.6 / 1.88 GB
    s = plan.model_states(7.5e9, 64, stage, k=12)
    assert round(s.model_state_bytes / GB, digits) == seed_gb
    assert s.total_bytes == s.model_state_bytes  # no gathered units given


def test_70b_params_and_zero2():
    assert plan.model_states(70e9, 1, 0).param_bytes / GB == pytest.approx(140)  # guide §8
    z2 = plan.model_states(70e9, 64, 2).model_state_bytes / GB  # guide §9.4: "> 140 GB"
    assert z2 > 140 and z2 == pytest.approx(155, abs=0.5)


def test_fp32_grad_acc_and_gathered_units():
    # guide §9: +4Ψ for DP/ZeRO-1, +4Ψ/N for ZeRO-2/3; ZeRO-3 holds two gathered bf16 units
    psi, n = 1e9, 8
    base = [plan.model_states(psi, n, s).model_state_bytes for s in range(4)]
    acc = [plan.model_states(psi, n, s, fp32_grad_acc=True).model_state_bytes for s in range(4)]
    assert [a - b for a, b in zip(acc, base)] == pytest.approx([4 * psi, 4 * psi, 4 * psi / n, 4 * psi / n])
    z3 = plan.model_states(psi, n, 3, unit_params=1e7, layers=10)
    assert z3.gathered_unit_bytes == pytest.approx(2 * 2 * 1e7)
    assert z3.allgathers_per_step == 19  # 2L - 1
    assert [plan.model_states(psi, n, s).comm_elements_per_step / psi for s in range(4)] == [2, 2, 2, 3]


def test_pure_dp_max_model_on_tpu():
    # guide §8: 10 bytes/param (bf16 param + fp32 Adam m, v) on a 96 GB TPU v5p -> about 9B (9.6B)
    hbm = plan.get_hardware("TPU v5p").hbm_bytes
    assert plan.max_params(hbm, 10).max_params / 1e9 == pytest.approx(9.6)


def test_allreduce_8b_inside_and_across_nodes():
    grads = 2 * 8e9  # guide §2.4: 8B model, bf16 gradients, V = 16 GB
    inside = plan.collective_time("all_reduce", grads, 8, "H100")
    assert inside.bandwidth_s * 1e3 == pytest.approx(62, abs=0.5)
    assert inside.time_s * 1e3 == pytest.approx(62, abs=0.5)
    across = plan.collective_time("all_reduce", grads, 16384, "H100")
    assert across.bottleneck == "inter"
    assert across.bandwidth_s * 1e3 == pytest.approx(80, abs=0.5)


def test_small_message_latency_moves_7mb():
    # guide §4: 16 µs on 8xH100 NVLink (450 GB/s) moves ~7 MB
    r = plan.collective_time("all_reduce", 0, 8, "H100")
    assert r.latency_s == pytest.approx(16e-6)
    assert round(r.latency_bytes / 1e6) == 7
    # and the crossover V* = NαW with α = α′ / (2(N−1))
    assert r.crossover_bytes == pytest.approx(8 * (16e-6 / 14) * 450e9)


def test_batch_example():
    # guide §6.1: 4M tokens, seq 4k -> 1024 samples; mbs 2 on 128 GPUs -> grad_acc 4; 512 -> 1
    b = plan.plan_batch(4 * 2**20, 4096, 2, 128)
    assert (b.samples, b.grad_acc, b.warnings) == (1024, 4, [])
    assert plan.plan_batch(4e6, 4096, 2, 512).grad_acc == 1  # 976.6 samples round to 1024 too
    rich = plan.plan_batch(4 * 2**20, 4096, 2, 1024)
    assert rich.gpu_rich and "GPU-rich" in rich.warnings[0]
    odd = plan.plan_batch(4 * 2**20, 4096, 2, 96)
    assert not odd.gpu_rich and "not divisible" in odd.warnings[0]


def test_thresholds():
    assert plan.threshold("H100").threshold_tokens == pytest.approx(2475)  # §7.2 across nodes
    assert plan.threshold("H100").intra_c_over_w == pytest.approx(2200)  # §10.2 inside a node
    two_nodes = plan.threshold("H100", 16)  # §7.3: NVLink leg V/514e9 becomes the bottleneck
    assert two_nodes.bottleneck == "intra" and two_nodes.threshold_tokens == pytest.approx(1900, rel=0.015)
    h800 = plan.threshold("H800")  # §7.2: 200e9 · 8/7 = 229e9
    assert h800.bottleneck == "intra" and h800.threshold_tokens == pytest.approx(4300, rel=0.01)
    assert plan.threshold("TPU v5p").threshold_tokens == pytest.approx(2550, rel=1e-3)
    assert plan.threshold("TPU v5p", axes=3).threshold_tokens == pytest.approx(850, rel=1e-3)


def test_small_dp_correction_halves_at_two():
    # guide §7.3: (X−1)/X; at X = 2 the threshold is half of C/W
    r = plan.threshold("H100", 2)
    assert r.threshold_tokens == pytest.approx(r.intra_c_over_w / 2)


def test_min_batches():
    llama = plan.threshold("H100", 16384).min_batch_tokens  # §7.2: ≈ 40M, it used 16M
    assert llama / 1e6 == pytest.approx(40, rel=0.02) and llama > 16e6
    ds = plan.threshold("H800", 2048).min_batch_tokens  # ≈ 8.8M if dense
    assert ds / 1e6 == pytest.approx(8.8, rel=0.01)
    pod = plan.threshold("TPU v5p", 8960, axes=3).min_batch_tokens  # ≈ 7.6M
    assert round(pod / 1e6, 1) == 7.6


def test_moe_thresholds():
    gpt = plan.threshold("H100", model="gpt-oss-120b")  # §7.3: 32 × 2475 ≈ 79,000
    assert gpt.moe_factor == 32 and gpt.threshold_tokens == pytest.approx(79_000, rel=0.01)
    ds = plan.threshold("H800", model="deepseek-v3")  # 32 × 4300 ≈ 138,000
    assert ds.threshold_tokens == pytest.approx(138_000, rel=0.01)
    assert plan.threshold("H100", experts=128, experts_per_token=4).threshold_tokens == gpt.threshold_tokens


def test_max_chips_for_a_batch():
    # guide §7.5: 38M tokens (9216 × 4K) at 850/chip ≈ 44,000 chips; 16M ≈ 18,800
    v2 = plan.max_devices("TPU v5p", 9216 * 4096, axes=3).max_devices
    assert v2 == pytest.approx(44_000, rel=0.015)
    assert plan.max_devices("TPU v5p", 16e6, axes=3).max_devices == pytest.approx(18_800, rel=0.005)


def test_whole_model_and_layer_forms_agree_with_threshold():
    # guide §7.4: Ψ cancels; compute = comm exactly at the corrected per-device threshold
    r = plan.threshold("H100", 8)
    for psi in (1e9, 70e9):
        w = plan.whole_model(psi, r.threshold_tokens, 8, "H100")
        assert w.compute_s == pytest.approx(w.comm_s)
        assert w.threshold_tokens == pytest.approx(r.threshold_tokens)
    # guide §10.2: seq 4096, mbs 1 hides a layer's AllGather inside a node; seq 512 does not
    assert plan.layer_prefetch(4096, 4096, 1, 8, "H100").hidden_by_compute
    assert not plan.layer_prefetch(4096, 512, 1, 8, "H100").hidden_by_compute


def test_report_covers_design_table():
    rep = plan.build_report()
    assert len(rep.rows) >= 27
    assert rep.row("threshold_tpu_3axes").shown == "850"
    assert "1.88 GB" in rep.text()


def test_activation_memory_korthikanti():
    # Korthikanti et al. 2022 (t = 1): sbh(34 + 5as/h), selective 34sbh, full 2sbh per layer
    s, b, h, a, L = 2048, 2, 1024, 16, 4
    none = plan.activations(L, h, a, s, b, recompute="none", attention="eager")
    assert none.per_layer_bytes == s * b * h * (34 + 5 * a * s / h)
    # FlashAttention/SDPA (the default) stores no a·s²·b scores, with or without recomputation
    assert plan.activations(L, h, a, s, b).per_layer_bytes == 34 * s * b * h
    assert plan.activations(L, h, a, s, b, recompute="selective",
                            attention="eager").per_layer_bytes == 34 * s * b * h
    assert plan.activations(L, h, a, s, b, recompute="selective").per_layer_bytes == 34 * s * b * h
    full = plan.activations(L, h, a, s, b, recompute="full", vocab=1000)
    assert full.per_layer_bytes == 2 * s * b * h
    assert full.total_bytes == L * 2 * s * b * h + 5 * s * b * h + 12 * s * b * 1000
    # the loss's peak: fp32 logits, their log-softmax and its gradient, 12 bytes per logit
    assert plan.memory.LOSS_PEAK_BYTES == 12
