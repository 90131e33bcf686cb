"""The catalogue: model families `transformers` ships, built from small configs (no downloads).

Each family is one line of `FAMILIES`: a config class, a model class, the config's fields and the
task that says what a batch is and which loss trains it. Every model runs in float32 (the
BatchNorm networks and CLIP in float64: `Family.dtype`) with dropout
off (`workload(..., dropout=0.1)` sets every rate). A family whose forward couples
the samples of a batch (BatchNorm, an in-batch loss, expert capacity) says how in `coupled`: data
parallelism and microbatches change its result, so it is compared against one process run on the
same per-replica slices (`tests.test_families.single`). The tests train a slice of the catalogue,
`benchmarks/families.py` all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

import autopar

BATCH, SEQ, VOCAB, LABELS = 8, 16, 128, 4


@dataclass(frozen=True)
class Family:
    config: str  # the transformers config class
    model: str  # the transformers model class
    fields: dict = field(default_factory=dict)
    task: str = "causal"  # a key of TASKS
    coupled: str = ""  # how its forward couples the samples of a batch, if it does
    coupled_in_loss: bool = False  # only its loss does: slices are the last stage's
    eager: bool = False  # transformers' eager attention (else the family's default, sdpa where it has it)
    # float64 where float32 cannot resolve the comparison: rounding alone takes its one-process run
    # more than half the tolerance from its own float64 run (`benchmarks/families.py --floor`; the
    # parallel run's rounding may double it). Most families: 1 %; CLIP 75 %; BatchNorm nets 18× to 10⁵×
    dtype: torch.dtype = torch.float32


# small and alike: 4 blocks of hidden 32 with 4 heads (2 key/value heads where the family has them)
_DEC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=64)
_ENC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=VOCAB,
            max_position_embeddings=64)
_GPT = dict(n_layer=4, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64)
_BART = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=1,
             decoder_start_token_id=2)
_T5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=VOCAB,
           decoder_start_token_id=0)
_VIT = dict(_ENC, image_size=16, patch_size=4, num_channels=3, num_labels=10)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

FAMILIES: dict[str, Family] = {
    # decoders
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel", dict(_GPT, bos_token_id=0, eos_token_id=0)),
    "llama": Family("LlamaConfig", "LlamaForCausalLM", _DEC),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", _DEC),  # QKV biases
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", dict(_DEC, head_dim=8)),  # per-head q/k norms
    "mistral": Family("MistralConfig", "MistralForCausalLM", dict(_DEC, sliding_window=8)),  # window < sequence
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", dict(_DEC, head_dim=8)),  # GeGLU, tied, scaled embeddings
    # tied embeddings, logit soft-capping, a sliding window shorter than the sequence every other layer
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", dict(_DEC, head_dim=8, sliding_window=8)),
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_DEC, head_dim=8, sliding_window=8)),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", _DEC),  # q/k norms over all heads at once
    "cohere": Family("CohereConfig", "CohereForCausalLM", _DEC),  # parallel attention and MLP, logit scale
    "stablelm": Family("StableLmConfig", "StableLmForCausalLM", dict(_DEC, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))),  # partial rotary
    "phi": Family("PhiConfig", "PhiForCausalLM", dict(_DEC, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),  # partial rotary, parallel blocks
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", dict(_DEC, pad_token_id=0)),  # fused QKV and gate-up
    # multi-query attention through one fused QKV projection, parallel attention and MLP, rotary
    "falcon": Family("FalconConfig", "FalconForCausalLM", dict(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=4, vocab_size=VOCAB, multi_query=True,
        parallel_attn=True, new_decoder_architecture=False, alibi=False, bias=False)),
    "gpt-neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(  # fused QKV, partial rotary, parallel residual
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64)),
    "gpt-bigcode": Family("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(_GPT, multi_query=True)),  # MQA, fused
    "gpt-j": Family("GPTJConfig", "GPTJForCausalLM", dict(_GPT, rotary_dim=4)),  # interleaved partial rotary
    "codegen": Family("CodeGenConfig", "CodeGenForCausalLM", dict(_GPT, n_ctx=64, rotary_dim=4)),  # QKV in 4 groups
    "gpt-neo": Family("GPTNeoConfig", "GPTNeoForCausalLM", dict(  # local attention (window 8) every other layer
        hidden_size=32, num_layers=4, num_heads=4, attention_types=[[["global", "local"], 2]], window_size=8,
        vocab_size=VOCAB, max_position_embeddings=64)),
    "bloom": Family("BloomConfig", "BloomForCausalLM", dict(  # ALiBi, fused QKV
        hidden_size=32, n_layer=4, n_head=4, vocab_size=VOCAB)),
    "mpt": Family("MptConfig", "MptForCausalLM", dict(d_model=32, n_heads=4, n_layers=4, expansion_ratio=2,
                                                     max_seq_len=64, vocab_size=VOCAB)),  # ALiBi
    "opt": Family("OPTConfig", "OPTForCausalLM", dict(  # learned positions, embeddings projected in and out
        hidden_size=32, ffn_dim=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64, word_embed_proj_dim=16)),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", dict(  # top-2 of 4 experts, data-dependent routing
        _DEC, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)),
    "qwen2-moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(  # routed experts and a gated shared one
        _DEC, **_MOE, shared_expert_intermediate_size=32)),
    "olmoe": Family("OlmoeConfig", "OlmoeForCausalLM", dict(_DEC, num_experts=4, num_experts_per_tok=2)),
    "deepseek-v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(  # latent attention (MLA), MoE
        _DEC, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)),
    # the last token that is not padding picks the logits (an index the batch computes)
    "llama-classify": Family("LlamaConfig", "LlamaForSequenceClassification", dict(_DEC, num_labels=LABELS,
                                                                                   pad_token_id=0), "classify"),
    # encoders
    "bert": Family("BertConfig", "BertForMaskedLM", _ENC, "masked"),
    "roberta": Family("RobertaConfig", "RobertaForMaskedLM", dict(_ENC, pad_token_id=1), "masked"),
    "distilbert": Family("DistilBertConfig", "DistilBertForMaskedLM", dict(
        dim=32, hidden_dim=64, n_layers=4, n_heads=4, vocab_size=VOCAB, max_position_embeddings=64), "masked"),
    "albert": Family("AlbertConfig", "AlbertForMaskedLM", dict(  # one block's weights shared by every layer
        _ENC, embedding_size=16), "masked"),
    "electra": Family("ElectraConfig", "ElectraForMaskedLM", dict(_ENC, embedding_size=16), "masked"),
    "deberta-v2": Family("DebertaV2Config", "DebertaV2ForMaskedLM", dict(  # disentangled relative attention
        _ENC, relative_attention=True, position_buckets=8, max_relative_positions=16, pos_att_type=["p2c", "c2p"]),
        "masked"),
    "mpnet": Family("MPNetConfig", "MPNetForMaskedLM", _ENC, "masked"),  # relative position buckets
    "modernbert": Family("ModernBertConfig", "ModernBertForMaskedLM", dict(  # local and global attention, rotary
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64, local_attention=8, global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=0,
        eos_token_id=0, cls_token_id=0, sep_token_id=0), "masked"),
    # encoder-decoders
    "t5": Family("T5Config", "T5ForConditionalGeneration", _T5, "seq2seq", eager=True),
    # keyword inputs (input_ids, decoder_input_ids), the attention mask between them left at None
    "t5-keywords": Family("T5Config", "T5ForConditionalGeneration", _T5, "seq2seq-keywords", eager=True),
    "bart": Family("BartConfig", "BartForConditionalGeneration", _BART, "seq2seq"),
    "marian": Family("MarianConfig", "MarianMTModel", dict(_BART, decoder_vocab_size=VOCAB, pad_token_id=1,
                                                           decoder_start_token_id=1), "seq2seq"),
    "whisper": Family("WhisperConfig", "WhisperForConditionalGeneration", dict(  # log-mel frames in, tokens out
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB, num_mel_bins=8, max_source_positions=16,
        max_target_positions=32, pad_token_id=1, decoder_start_token_id=2, bos_token_id=2, eos_token_id=3,
        suppress_tokens=[], begin_suppress_tokens=[]), "speech"),
    # expert capacity: which tokens an expert drops depends on the whole batch
    "switch": Family("SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration", dict(
        _T5, num_experts=4, expert_capacity=8, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
        router_jitter_noise=0.0), "seq2seq", coupled="expert capacity", eager=True),
    # vision
    "vit": Family("ViTConfig", "ViTForImageClassification", _VIT, "image"),
    "deit": Family("DeiTConfig", "DeiTForImageClassification", _VIT, "image"),
    "beit": Family("BeitConfig", "BeitForImageClassification", dict(  # relative position bias
        _VIT, use_relative_position_bias=True), "image"),
    "dinov2": Family("Dinov2Config", "Dinov2ForImageClassification", dict(_VIT, mlp_ratio=2), "image"),
    "swin": Family("SwinConfig", "SwinForImageClassification", dict(  # shifted windows (torch.roll), patch merging
        image_size=16, patch_size=2, embed_dim=16, depths=[2, 1], num_heads=[2, 4], window_size=4, num_labels=10),
        "image"),
    # channels-last blocks: NCHW permuted to NHWC around each LayerNorm and MLP
    "convnext": Family("ConvNextConfig", "ConvNextForImageClassification", dict(
        hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=10), "image32"),
    "resnet": Family("ResNetConfig", "ResNetForImageClassification", dict(
        embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=10), "image32",
        coupled="BatchNorm", dtype=torch.float64),
    "regnet": Family("RegNetConfig", "RegNetForImageClassification", dict(  # grouped convolutions
        embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], groups_width=8, num_labels=10),
        "image32", coupled="BatchNorm", dtype=torch.float64),
    "mobilenet-v2": Family("MobileNetV2Config", "MobileNetV2ForImageClassification", dict(  # depthwise convolutions
        image_size=32, depth_multiplier=0.25, num_labels=10), "image32",
        coupled="BatchNorm", dtype=torch.float64),
    # audio
    "wav2vec2": Family("Wav2Vec2Config", "Wav2Vec2ForSequenceClassification", dict(  # convolutional features
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, conv_dim=(16, 16),
        conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
        num_labels=LABELS, layerdrop=0.0, mask_time_prob=0.0, classifier_proj_size=16), "audio"),
    # multimodal: text and image towers, every image scored against every text of the batch
    "clip": Family("CLIPConfig", "CLIPModel", dict(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=VOCAB, max_position_embeddings=SEQ, projection_dim=16, bos_token_id=0,
                         eos_token_id=2),  # 2: the pooled token is each text's largest id (CLIP's first vocabulary)
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=4, projection_dim=16), projection_dim=16),
        "contrastive", coupled="in-batch contrastive loss", coupled_in_loss=True, dtype=torch.float64),
}


def _causal(batch: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=gen)
    return (ids[:, :-1],), ids[:, 1:]


def _padded(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (2 and up: 0 and 1 are some families' padding) and a mask padding half the samples."""
    ids = torch.randint(2, VOCAB, (batch, SEQ), generator=gen)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    mask[batch // 2:, SEQ - 4:] = 0  # padded samples: the attention mask matters
    return ids, mask


def _masked(batch: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    ids, mask = _padded(batch, gen)
    return (ids, mask), torch.randint(0, VOCAB, (batch, SEQ), generator=gen)


def _classify(batch: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    ids, mask = _padded(batch, gen)
    return (ids.masked_fill(mask == 0, 0), mask), torch.randint(0, LABELS, (batch,), generator=gen)


def _image(batch: int, gen: torch.Generator, size: int = 16) -> tuple[tuple, torch.Tensor]:
    return (torch.randn(batch, 3, size, size, generator=gen),), torch.randint(0, 10, (batch,), generator=gen)


def _image32(batch: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    return _image(batch, gen, 32)





def _seq2seq(batch: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    ids, mask = _padded(batch, gen)
    labels = torch.randint(2, VOCAB, (batch, SEQ // 2 + 1), generator=gen)
    return (ids, mask, labels[:, :-1]), labels[:, 1:]  # forward(input_ids, attention_mask, decoder_input_ids)


def _seq2seq_keywords(batch: int, gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    (ids, _, decoder_ids), target = _seq2seq(batch, gen)
    return {"input_ids": ids, "decoder_input_ids": decoder_ids}, target


def _speech(batch: int, gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    """Log-mel features (8 bins, 32 frames: twice the encoder's positions) and the tokens so far."""
    labels = torch.randint(4, VOCAB, (batch, SEQ // 2 + 1), generator=gen)
    return {"input_features": torch.randn(batch, 8, 32, generator=gen), "decoder_input_ids": labels[:, :-1]}, \
        labels[:, 1:]


def _audio(batch: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    return (torch.randn(batch, 400, generator=gen),), torch.randint(0, LABELS, (batch,), generator=gen)


def _contrastive(batch: int, gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    ids = torch.randint(2, VOCAB, (batch, SEQ), generator=gen)
    pixels = torch.randn(batch, 3, 16, 16, generator=gen)
    return {"input_ids": ids, "pixel_values": pixels}, torch.zeros(batch, dtype=torch.long)  # target unused


def _token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _contrastive_loss(logits_per_image: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric loss: the i-th image belongs with the i-th text of the same batch."""
    pairs = torch.arange(logits_per_image.shape[0], device=logits_per_image.device)
    return (nn.functional.cross_entropy(logits_per_image, pairs) +
            nn.functional.cross_entropy(logits_per_image.t(), pairs)) / 2


TASKS = {"causal": (_causal, _token_loss), "masked": (_masked, _token_loss),
         "classify": (_classify, nn.functional.cross_entropy), "image": (_image, nn.functional.cross_entropy),
         "image32": (_image32, nn.functional.cross_entropy), "seq2seq": (_seq2seq, _token_loss),
         "seq2seq-keywords": (_seq2seq_keywords, _token_loss), "speech": (_speech, _token_loss),
         "audio": (_audio, nn.functional.cross_entropy), "contrastive": (_contrastive, _contrastive_loss)}


def _set_dropout(config, rate: float) -> None:
    """Every `*dropout*` / `*_pdrop` rate of the config (and its sub-configs) set to `rate`."""
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop") or key == "drop_path_rate"):
            setattr(config, key, rate)
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
            _set_dropout(value, rate)


# The tests' depth (`layers=`): capture, planning, export and lowering scale with the graph, and two
# blocks already put a block on either side of every cut a 2-stage pipeline makes. The sweep
# (`benchmarks/families.py`) and the schedules of 4 stages or virtual chunks keep the catalogue's 4.
TEST_LAYERS = 2
_DEPTH = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def with_layers(fields: dict, layers: int | None) -> dict:
    """A config's fields with `layers` blocks where the catalogue gives it 4 (None: as given)."""
    if layers is None:
        return fields
    out = {k: layers if k in _DEPTH and v == 4 else v for k, v in fields.items()}
    if "attention_types" in fields:  # GPT-Neo: a [pattern, repeats] list whose repeats cover every layer
        out["attention_types"] = [[pattern, layers // len(pattern)] for pattern, _ in fields["attention_types"]]
    return out


def workload(name: str, batch: int = BATCH, dropout: float = 0.0, layers: int | None = None) -> autopar.Workload:
    """The family's model (seeded by the caller) with a batch maker and the loss of its task, every
    dropout rate of its config set to `dropout`, with `layers` blocks (None: the catalogue's).

    The loss receives the logits under every layout (`autopar.parallelize`'s loss contract)."""
    import transformers

    family = FAMILIES[name]
    config = getattr(transformers, family.config)(**with_layers(family.fields, layers))
    _set_dropout(config, dropout)
    if family.eager:
        config._attn_implementation = "eager"
    model = getattr(transformers, family.model)(config).to(family.dtype)
    task, loss = TASKS[family.task]

    def make_batch(size: int, gen: torch.Generator):
        inputs, target = task(size, gen)
        return _retyped(inputs, family.dtype), target

    return autopar.Workload(f"hf-{name}", model, make_batch(batch, torch.Generator())[0], batch, loss, make_batch)


def _retyped(inputs, dtype: torch.dtype):
    """Floating-point inputs in the model's dtype."""
    def one(x):
        return x.to(dtype) if x.is_floating_point() else x
    return {k: one(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(one(x) for x in inputs)


# ---- training a family: one process (the reference) and one rank of a parallel job ----

STEPS = 2


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def to_device(inputs, device):
    if isinstance(inputs, dict):
        return {k: v.to(device) for k, v in inputs.items()}
    return tuple(x.to(device) for x in inputs)


def setup(name: str, seed: int = 0, steps: int = STEPS, device: str = "cpu", dropout: float = 0.0,
          layers: int | None = None):
    """The family's model (built from `seed`, `layers` blocks) on `device` and `steps` batches of its
    task there."""
    torch.manual_seed(seed)
    w = workload(name, dropout=dropout, layers=layers)
    w.model.to(device)
    w.example_inputs = to_device(w.example_inputs, device)
    g = torch.Generator().manual_seed(5)
    batches = [w.make_batch(w.batch, g) for _ in range(steps)]
    return w, [(to_device(inputs, device), target.to(device)) for inputs, target in batches]


def _cut(inputs, parts: int, index: int):
    if isinstance(inputs, dict):
        return {k: v.tensor_split(parts)[index] for k, v in inputs.items()}
    return tuple(x.tensor_split(parts)[index] for x in inputs)


def single(name: str, steps: int = STEPS, device: str = "cpu", slices: int = 1, dropout: float = 0.0,
           layers: int | None = None):
    """Losses and final parameters of one process training the family. `slices` > 1 (families whose
    forward couples samples): each step's batch is cut into that many equal slices, in order, and
    the mean of their losses trained, as data-parallel replicas and microbatches compute it. One
    thread, as each rank of the tests runs: kernels then sum in the same order (a BatchNorm network
    amplifies the last bits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _single(name, steps, device, slices, dropout, layers)
    finally:
        torch.set_num_threads(threads)


def _single(name: str, steps: int, device: str, slices: int, dropout: float, layers: int | None):
    w, batches = setup(name, steps=steps, device=device, dropout=dropout, layers=layers)
    opt = optimizer(list(w.model.parameters()))
    losses = []
    for inputs, target in batches:
        opt.zero_grad()
        total = 0.0
        for i in range(slices):
            part = _cut(inputs, slices, i)
            out = w.model(**part) if isinstance(part, dict) else w.model(*part)
            loss = w.loss_fn(autopar.first_tensor(out), target.tensor_split(slices)[i]) / slices
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in w.model.named_parameters()}


def loss_slices(pm, in_loss: bool = False) -> int | None:
    """Into how many equal slices, in order, the job cut each step's batch for every op and loss
    that couples samples: data-parallel replicas × microbatches (× tensor-parallel ranks where each
    holds some samples of the output). `in_loss`: only the loss couples them, and it runs in the last
    stage. Else None where stages cut the batch differently (a searched pipeline of 2 replicas, then
    1): no one process computes what such a job does with a coupled forward."""
    plan = pm.plan
    if not in_loss and len({s.logical_mesh[0] for s in plan.stages}) > 1:
        return None
    graph = getattr(pm, "graph", None)
    return plan.stages[-1].logical_mesh[0] * plan.num_microbatches * (
        plan.stages[-1].logical_mesh[1] if graph is not None and graph.output_shard else 1)


def differences(got_losses, got_params, losses, params, rel: float = 1e-5, atol: float = 1e-6) -> list[str]:
    """What differs from one process: losses (rel), parameters (rel, or `atol` where the reference is
    below it: some key biases receive no gradient). Empty: equal."""
    out = [f"loss of step {i}: {a!r} against {b!r}" for i, (a, b) in enumerate(zip(got_losses, losses))
           if not abs(a - b) <= rel * abs(b)]
    if len(got_losses) != len(losses):
        out.append(f"{len(got_losses)} losses against {len(losses)}")
    if got_params.keys() != params.keys():
        out.append(f"parameters {sorted(got_params.keys() ^ params.keys())[:3]} on one side only")
    for key in got_params.keys() & params.keys():
        a, b = got_params[key].float(), params[key].float()
        if a.shape != b.shape or not torch.allclose(a, b, rtol=rel, atol=atol):
            out.append(f"parameter {key}: max abs difference "
                       f"{(a - b).abs().max().item() if a.shape == b.shape else 'shape'}")
    return out


def train_parallel(rank: int, world: int, name: str, layout: str | None, steps: int = STEPS,
                   seed: int = 0, layers: int | None = None) -> dict:
    """One rank of a job training the family (`layers` blocks) under `layout` ("DP,TP,PP[,MB][+...]",
    None: the search). A plan `parallelize` refuses comes back as {"refused": message}; a failure
    later raises."""
    w, batches = setup(name, seed=seed, steps=steps, layers=layers)
    try:
        pm = autopar.parallelize(w.model, (1, world), w.example_inputs, loss_fn=w.loss_fn, optimizer=optimizer,
                                 plan=layout)
    except autopar.AutoparError as exc:  # a refusal another rank announced: its words
        return {"refused": exc.message if getattr(exc, "user", False) else str(exc)}
    losses = [pm.step(inputs, target) for inputs, target in batches]
    stages = " + ".join(f"{s.logical_mesh[0]}x{s.logical_mesh[1]}" for s in pm.plan.stages)
    return {"losses": losses, "params": pm.full_state_dict(), "slices": loss_slices(pm, FAMILIES[name].coupled_in_loss),
            "plan": f"{pm.plan.name}: {stages}, {pm.plan.num_microbatches} microbatches",
            "programs": pm.programs()}
