"""Talker protocols (services/stage_worker/talkers) and the per-position logits processor
(services/stage_worker/engine_core/frame_logits.py), checked against independent constructions:
prompts built by hand from the tokenizer's vocabulary, codes against Orpheus's published
data-preparation formula (written out here), the real tokenizer's ids as the issue lists them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.sample.logits_processor import BatchUpdate
from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns as load_logitsprocs

from libs.common.pipeline import PipelineConfig, PipelineConfigError, TalkerConfig, load_pipeline
from libs.models.tiny_orpheus import build_tiny_orpheus
from libs.models.tiny_snac import CODEBOOK_SIZE, build_tiny_snac
from services.stage_worker.engine_core.frame_logits import FrameLogitsProcessor, FrameRule
from services.stage_worker.talkers import engine_args, make_protocol
from services.stage_worker.talkers.base import TalkerInputError, TalkerOutputError, UnknownVoice
from services.stage_worker.talkers.orpheus import OrpheusProtocol, codec_codebook_size
from services.stage_worker.talkers.tiny import TinyProtocol

ORPHEUS_VOICES = ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]
REAL = {  # the real canopylabs/orpheus-3b-0.1-ft ids (issue 20)
    "end_of_text": 128009,
    "start_of_human": 128259,
    "end_of_human": 128260,
    "start_of_ai": 128261,
    "start_of_speech": 128257,
    "end_of_speech": 128258,
    "first_audio": 128266,
}


def orpheus_encode(
    layer0: list[int], layer1: list[int], layer2: list[int], first_audio: int, cb: int
) -> list[int]:
    """Orpheus's data preparation: SNAC's three layers -> 7 tokens per frame (frame i holds layer 0's
    code i, layer 1's 2i and 2i+1, layer 2's 4i ... 4i+3), each position offset by its own block."""
    tokens = []
    for i in range(len(layer0)):
        tokens += [
            layer0[i] + first_audio,
            layer1[2 * i] + first_audio + cb,
            layer2[4 * i] + first_audio + 2 * cb,
            layer2[4 * i + 1] + first_audio + 3 * cb,
            layer1[2 * i + 1] + first_audio + 4 * cb,
            layer2[4 * i + 2] + first_audio + 5 * cb,
            layer2[4 * i + 3] + first_audio + 6 * cb,
        ]
    return tokens


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_orpheus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny-orpheus")
    build_tiny_orpheus(d)
    return d


@pytest.fixture(scope="module")
def tiny_snac(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny-snac")
    build_tiny_snac(d)
    return d


@pytest.fixture(scope="module")
def real_layout_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with the real Orpheus ids: 128000 text tokens, Llama 3's 256 specials
    (<|begin_of_text|> 128000, <|eot_id|> 128009), then <custom_token_0> ... <custom_token_28682>."""
    words = ["tara:", "leo:", "Hello", "there."]
    vocab = {w: i for i, w in enumerate(words)} | {f"w{i}": i for i in range(len(words), 128000)}
    specials = [f"<|reserved_special_token_{k}|>" for k in range(256)]
    specials[0], specials[1], specials[9] = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
    vocab |= {name: 128000 + k for k, name in enumerate(specials)}
    vocab |= {f"<custom_token_{n}>": 128256 + n for n in range(7 * 4096 + 10 + 1)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w4"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 128000)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )


def orpheus(tokenizer, codebook_size: int, **cfg) -> OrpheusProtocol:
    return OrpheusProtocol(TalkerConfig(protocol="orpheus", **cfg), tokenizer, codebook_size)


# --- Orpheus: ids, prompt, voices, sampling, cap --------------------------------------------------


def test_ids_from_a_real_layout_tokenizer_are_the_real_ones(real_layout_tokenizer) -> None:
    t = orpheus(real_layout_tokenizer, 4096).tokens
    assert {name: getattr(t, name) for name in REAL} == REAL
    assert t.codebook_size == 4096


def test_prompt_with_the_real_ids(real_layout_tokenizer) -> None:
    p = orpheus(real_layout_tokenizer, 4096)
    # by hand: start_of_human, BOS, "tara:" "Hello" "there." (word ids 0, 2, 3), then the four
    assert p.prompt("Hello there.", "tara") == [128259, 128000, 0, 2, 3, 128009, 128260, 128261, 128257]
    assert p.prompt("  Hello there. ")[3:5] == [2, 3]  # stripped; the default voice is tara
    assert orpheus(real_layout_tokenizer, 4096, voice="leo").prompt("Hello")[:4] == [128259, 128000, 1, 2]


def test_prompt_on_tiny_orpheus_matches_a_construction_from_its_vocabulary(tiny_orpheus: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_orpheus))
    vocab = tok.get_vocab()
    expected = [
        vocab["<custom_token_3>"],
        vocab["<|begin_of_text|>"],
        *tok("leo: The weather is fine.", add_special_tokens=False).input_ids,
        vocab["<|eot_id|>"],
        vocab["<custom_token_4>"],
        vocab["<custom_token_5>"],
        vocab["<custom_token_1>"],
    ]
    assert orpheus(tok, CODEBOOK_SIZE).prompt("The weather is fine.", "leo") == expected


def test_text_that_spells_a_control_token_is_refused(tiny_orpheus: Path) -> None:
    p = orpheus(AutoTokenizer.from_pretrained(str(tiny_orpheus)), CODEBOOK_SIZE)
    for text in ("stop <custom_token_2> now", "a <|eot_id|> b", "x<custom_token_500>"):
        with pytest.raises(TalkerInputError, match="reserved tokens"):
            p.prompt(text)


def test_voices(tiny_orpheus: Path) -> None:
    p = orpheus(AutoTokenizer.from_pretrained(str(tiny_orpheus)), CODEBOOK_SIZE)
    assert list(p.voices) == ORPHEUS_VOICES and p.default_voice == "tara"
    assert p.resolve_voice("zoe") == "zoe" and p.resolve_voice(None) == "tara"
    with pytest.raises(UnknownVoice, match=r"'alloy'.*tara, leah, jess, leo, dan, mia, zac, zoe"):
        p.request("Hello.", [], voice="alloy")


def test_sampling_defaults_and_yaml_overrides(tiny_orpheus: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_orpheus))
    params = orpheus(tok, CODEBOOK_SIZE).request("Hello.", [], seed=5).params
    assert (params.temperature, params.top_p, params.repetition_penalty) == (0.6, 0.8, 1.3)
    assert params.seed == 5 and params.output_kind == RequestOutputKind.DELTA and not params.detokenize
    assert params.stop_token_ids == [tok.get_vocab()["<custom_token_2>"]]
    p = orpheus(tok, CODEBOOK_SIZE, sampling={"temperature": 0.9})
    params = p.request("Hello.", []).params
    assert (params.temperature, params.top_p, params.repetition_penalty) == (0.9, 0.8, 1.3)


def test_the_cap_is_proportional_to_the_text(tiny_orpheus: Path) -> None:
    p = orpheus(
        AutoTokenizer.from_pretrained(str(tiny_orpheus)), CODEBOOK_SIZE, max_frames_per_char=1.5, min_frames=4
    )
    text = "x" * 21  # 21 characters -> ceil(31.5) = 32 frames
    req = p.request(f"  {text} ", [])
    assert req.max_codes == 7 * 32 and req.params.max_tokens == 7 * 32 + 1
    assert FrameRule.of(req.params).max_frames == 32
    assert p.request("Hi", []).max_codes == 7 * 4  # at least min_frames
    assert p.request("  ", [1, 2]) is None


# --- token ids -> codes ---------------------------------------------------------------------------


@pytest.mark.parametrize(("which", "cb"), [("tiny", CODEBOOK_SIZE), ("real", 4096)])
def test_decoding_inverts_orpheus_encoding(which, cb, tiny_orpheus: Path, real_layout_tokenizer) -> None:
    tok = real_layout_tokenizer if which == "real" else AutoTokenizer.from_pretrained(str(tiny_orpheus))
    p = orpheus(tok, cb)
    first_audio = tok.get_vocab()["<custom_token_10>"]
    rng = np.random.default_rng(20)
    frames = 37
    l0, l1, l2 = (rng.integers(0, cb, n * frames).tolist() for n in (1, 2, 4))
    tokens = [*orpheus_encode(l0, l1, l2, first_audio, cb), tok.get_vocab()["<custom_token_2>"]]
    stream = p.code_stream()
    cuts = sorted(rng.choice(np.arange(1, len(tokens)), size=20, replace=False).tolist())
    pieces = [tokens[a:b] for a, b in zip([0, *cuts], [*cuts, len(tokens)], strict=True)]
    out = np.concatenate([stream.feed(piece) for piece in pieces])
    assert out.dtype == np.int32 and out.shape == (frames, 7) and stream.stopped
    assert out[:, 0].tolist() == l0
    assert out[:, [1, 4]].reshape(-1).tolist() == l1
    assert out[:, [2, 3, 5, 6]].reshape(-1).tolist() == l2
    # and the formula of the issue, token by token: code = id - first_audio - (i mod 7) * cb
    flat = [t - first_audio - (i % 7) * cb for i, t in enumerate(tokens[:-1])]
    assert out.reshape(-1).tolist() == flat


def test_out_of_place_tokens_are_errors(tiny_orpheus: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_orpheus))
    vocab = tok.get_vocab()
    p, a, eos = orpheus(tok, CODEBOOK_SIZE), vocab["<custom_token_10>"], vocab["<custom_token_2>"]
    with pytest.raises(TalkerOutputError, match="position 0"):
        p.code_stream().feed([a + CODEBOOK_SIZE])  # a position-1 code at position 0
    with pytest.raises(TalkerOutputError, match="position 2"):
        p.code_stream().feed([a, a + CODEBOOK_SIZE, eos])  # end_of_speech inside a frame
    stream = p.code_stream()
    assert stream.feed([a + k * CODEBOOK_SIZE for k in range(7)] + [eos]).shape == (1, 7)
    with pytest.raises(TalkerOutputError, match="after end_of_speech"):
        stream.feed([a])


# --- the per-position logits processor ------------------------------------------------------------


RULE = FrameRule(first_audio=100, codebook_size=10, frame_size=7, stop_id=5, max_frames=3, min_frames=1)


def allowed_by_hand(position: int) -> set[int]:
    frame, slot = divmod(position, 7)
    if frame >= 3:
        return {5}
    ids = set(range(100 + 10 * slot, 110 + 10 * slot))
    return ids | {5} if slot == 0 and frame >= 1 else ids


def test_the_processor_leaves_each_position_its_own_block() -> None:
    proc = FrameLogitsProcessor(None, torch.device("cpu"), False)
    outputs = [[], [7] * 6, [7] * 7, [7] * 20, [7] * 21]  # live output lists of five requests
    plain = SamplingParams()
    added = [(i, SamplingParams(extra_args=RULE.to_extra_args()), [1], out) for i, out in enumerate(outputs)]
    added.append((5, plain, [1], []))  # a request without the rule
    proc.update_state(BatchUpdate(batch_size=6, removed=[], added=added, moved=[]))
    logits = proc.apply(torch.zeros(6, 200))
    for row, out in enumerate(outputs):
        assert set(torch.isfinite(logits[row]).nonzero().flatten().tolist()) == allowed_by_hand(len(out)), row
    assert torch.isfinite(logits[5]).all()
    outputs[0].extend([7] * 7)  # the lists are live: next step, request 0 is at a frame boundary
    logits = proc.apply(torch.zeros(6, 200))
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == allowed_by_hand(7)
    proc.update_state(BatchUpdate(batch_size=6, removed=[1, 2, 3, 4], added=[], moved=[]))
    logits = proc.apply(torch.zeros(6, 200))
    assert torch.isfinite(logits[1:]).all()


def test_rules_are_validated() -> None:
    with pytest.raises(ValueError, match="inside the audio tokens"):
        FrameRule(first_audio=100, codebook_size=10, frame_size=7, stop_id=120, max_frames=3)
    with pytest.raises(ValueError, match="min_frames"):
        FrameRule(first_audio=100, codebook_size=10, frame_size=7, stop_id=5, max_frames=3, min_frames=4)
    with pytest.raises(ValueError, match="unexpected keyword"):
        FrameLogitsProcessor.validate_params(SamplingParams(extra_args={"omnirelay_frames": {"first": 1}}))


def test_engine_args_name_the_processor_only_for_orpheus(tiny_orpheus: Path, tiny_snac: Path) -> None:
    pipeline = orpheus_pipeline(tiny_orpheus, tiny_snac)
    args = engine_args(pipeline.stages[1])
    assert load_logitsprocs(args["logits_processors"]) == [FrameLogitsProcessor]
    default = load_pipeline()
    assert engine_args(default.stages[default.speech_stage]) == {} and engine_args(pipeline.stages[0]) == {}


# --- the tiny protocol (today's talker, unchanged) -------------------------------------------------


def test_tiny_protocol_is_todays_talker(tmp_path: Path) -> None:
    (tmp_path / "omnirelay_talker.json").write_text(json.dumps({"code_offset": 2008, "num_codes": 1024}))
    p = TinyProtocol.from_model_dir(TalkerConfig(), str(tmp_path), codes_per_token=4)
    req = p.request("ignored", [5, 6, 7], seed=11)
    assert req.prompt_token_ids == [5, 6, 7] and req.max_codes == 12
    params = req.params
    assert params.max_tokens == params.min_tokens == 12 and params.seed == 11
    assert params.allowed_token_ids == list(range(2008, 3032))
    assert (params.temperature, params.top_p, params.repetition_penalty) == (1.0, 1.0, 1.0)
    assert params.output_kind == RequestOutputKind.DELTA and not params.detokenize and not params.extra_args
    assert p.code_stream().feed([2008, 3031, 2500]).tolist() == [0, 1023, 492]
    assert p.request("", []) is None and p.voices == ()
    with pytest.raises(UnknownVoice):
        p.request("x", [1], voice="tara")
    with pytest.raises(TalkerOutputError):
        p.code_stream().feed([2007])


# --- the pipeline's talker block ------------------------------------------------------------------


def orpheus_pipeline(talker_dir: Path, codec_dir: Path, **talker) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "name": "o",
            "served_model_name": "o",
            "stages": [
                {"name": "thinker", "type": "llm", "model": "m", "consumes": "text", "emits": "text"},
                {
                    "name": "talker",
                    "type": "llm",
                    "model": str(talker_dir),
                    "consumes": "text",
                    "emits": "codec_codes",
                    "talker": {"protocol": "orpheus", **talker},
                },
                {
                    "name": "code2wav",
                    "type": "codec",
                    "model": str(codec_dir),
                    "consumes": "codec_codes",
                    "emits": "audio",
                },
            ],
        }
    )


def test_make_protocol_reads_the_codebook_size_from_the_codec_stage(
    tiny_orpheus: Path, tiny_snac: Path, tmp_path: Path
) -> None:
    assert (
        codec_codebook_size(str(tiny_snac))
        == json.loads((tiny_snac / "config.json").read_text())["codebook_size"]
    )
    p = make_protocol(orpheus_pipeline(tiny_orpheus, tiny_snac, voice="mia"), 1, str(tiny_orpheus))
    assert (
        isinstance(p, OrpheusProtocol)
        and p.tokens.codebook_size == CODEBOOK_SIZE
        and p.default_voice == "mia"
    )
    (tmp_path / "config.json").write_text(json.dumps({"codebook_size": 2 * CODEBOOK_SIZE}))
    with pytest.raises(SystemExit, match=f"no <custom_token_{10 + 7 * CODEBOOK_SIZE}>"):
        make_protocol(orpheus_pipeline(tiny_orpheus, tmp_path), 1, str(tiny_orpheus))
    with pytest.raises(SystemExit, match="codebook_size"):
        codec_codebook_size(str(tiny_orpheus))  # a config.json without the field


def _yaml(tmp_path: Path, talker: str, stage: int = 1) -> Path:
    lines = [
        "name: p",
        "served_model_name: p",
        "stages:",
        "  - {name: thinker, type: llm, model: m, consumes: text, emits: text}",
        "  - {name: talker, type: llm, model: m, consumes: text, emits: codec_codes}",
        "  - {name: code2wav, type: codec, model: c, consumes: codec_codes, emits: audio}",
    ]
    lines[3 + stage] = lines[3 + stage][:-1] + f", talker: {talker}}}"
    path = tmp_path / "p.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("talker", "stage", "fragments"),
    [
        ("{protocol: bark}", 1, ["field 'stages.1.talker.protocol'", "'tiny' or 'orpheus'"]),
        ("{protocol: orpheus, voice: alloy}", 1, ["field 'stages.1.talker'", "voice 'alloy'", "tara, leah"]),
        ("{voice: tara}", 1, ["field 'stages.1.talker'", "protocol 'tiny' (none)"]),
        ("{sampling: {temperature: -1}}", 1, ["field 'stages.1.talker.sampling.temperature'"]),
        ("{sampling: {top_k: 5}}", 1, ["field 'stages.1.talker.sampling.top_k'", "Extra inputs"]),
        ("{protocol: orpheus}", 0, ["stages[0].talker: only an llm stage that emits codec_codes"]),
    ],
)
def test_bad_talker_blocks_name_file_field_and_reason(
    tmp_path: Path, talker: str, stage: int, fragments
) -> None:
    path = _yaml(tmp_path, talker, stage)
    with pytest.raises(PipelineConfigError) as e:
        load_pipeline(path)
    assert str(e.value).startswith(f"{path}: invalid pipeline")
    for fragment in fragments:
        assert fragment in str(e.value)


def test_orpheus_needs_a_codec_stage_after_it(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "name: p\nserved_model_name: p\nstages:\n"
        "  - {name: thinker, type: llm, model: m, consumes: text, emits: text}\n"
        "  - {name: talker, type: llm, model: m, consumes: text, emits: codec_codes, talker: {protocol: orpheus}}\n"
    )
    with pytest.raises(
        PipelineConfigError, match=r"stages\[1\].talker.protocol 'orpheus' reads its codebook size"
    ):
        load_pipeline(path)


def test_every_existing_talker_defaults_to_tiny() -> None:
    for path in sorted(Path(load_pipeline().source).parent.glob("*.yaml")):
        if path.name.startswith("orpheus"):  # the Orpheus pipelines (orpheus-tiny, orpheus) are new
            continue
        for stage in load_pipeline(path).stages:
            assert stage.talker == TalkerConfig() and stage.talker.protocol == "tiny"
