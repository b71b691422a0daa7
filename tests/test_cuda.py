"""The toolkit on a CUDA GPU, for ChatGLM-6B, ChatGLM3 and GLM-4: random tiny models of each version, built
here (`Version.tiny` on the texts and answers of data/spo_dev.jsonl), against the same weights in fp32 on the CPU.

- logits in fp32 / fp16 / bf16 on the GPU equal the CPU's fp32 ones within the dtype's tolerance (a left-padded
  batch, with and without a P-tuning v2 prefix);
- greedy `generation.generate` on the GPU gives the CPU's fp32 tokens wherever the CPU's top-2 logit margin is
  wider than twice that tolerance: each row is compared up to its first step of a narrower margin (after it the
  two may part legitimately); and its cached steps pick what one full GPU forward over the tokens picks;
- train.py (in this process) runs P-tuning v2 and LoRA with `--mixed-precision fp16` and `bf16`, and LoRA on an
  INT8 / INT4 base (`--quantization-bit`, QLoRA) on the GPU: every logged loss finite, the last below the first
  (8 steps on one batch of 8 records, lr 1e-2; P-tuning with `--prefix-projection`: a bare prefix barely moves
  the loss of a random ChatGLM-6B, whose blocks add their attention to sqrt(56) x the normalised input);
- a run trained on the GPU loads on the CPU (`loading.load_run(loading.resolve_run(run))`) with the logits of the
  trained GPU model moved to the CPU; `loading.load_run(..., device="cuda")` puts every tensor on the GPU;
- infer.py `--device cuda` runs a P-tuning and a LoRA run;
- INT8 / INT4 through the toolkit (`quant.apply.quantize_model` on the GPU: the CPU's integers and scales; the
  loader's `quantization_bit`, with and without `quantize_embedding`): logits and greedy tokens as on the CPU;
- the weight-only kernels of INT8 / INT4 layers on the GPU (intmm, tinygemm's int4mm) compute the dequantized
  matmul, and a weight held in tinygemm's layout reads back exactly; compiled decoding (static cache, CUDA graphs)
  gives the cached loop's tokens, float and INT8 / INT4;
- bitsandbytes INT8 / NF4 (`quant.apply.to_bitsandbytes`), when bitsandbytes imports: logits near the float
  ones, generation, and a LoRA step on it.

Marked `cuda`; the whole module is skipped where `torch.cuda.is_available()` is False (collection touches no
CUDA). The CPU references run in fp32 with the dequantizing kernel forced on quantized layers (the CPU's
int8pack / int4pack kernels compute in bf16).
"""

import json
import math
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState

import infer as infer_cli
import train as train_cli
from chatglm_tune.data.batches import SpecialIds, collate_prompts, collate_train, encode_record, prompt_ids
from chatglm_tune.data.records import SPORecord, read_records
from chatglm_tune.decoding.generation import generate
from chatglm_tune.models.registry import VERSIONS
from chatglm_tune.options import EncodingOptions, LoraOptions
from chatglm_tune.quant.apply import quantize_model
from chatglm_tune.quant.format import unpack_int4
from chatglm_tune.quant.modules import QuantizedLinear
from chatglm_tune.runs import loading, rundir
from chatglm_tune.runs.lora import apply_lora
from chatglm_tune.tuning import training

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT / "data" / "spo_dev.jsonl"
LINES = DEV.read_text(encoding="utf-8").splitlines()
CORPUS = [json.loads(line)["text"] for line in LINES] + [json.loads(line)["answer"] for line in LINES]
NAMES = ("chatglm", "chatglm3", "glm4")
GPU = "cuda"
ENCODING = EncodingOptions(max_src_len=64, max_len=96)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Largest logit error allowed against CPU fp32, in units of the reference logits' standard deviation. The CPU's
# own fp16 / bf16 runs of these models stay under 40% of these.
TOLERANCE = {"float32": 2e-4, "float16": 1.5e-2, "bfloat16": 1.2e-1}
NEW_TOKENS = 24
# Greedy tokens compared with the CPU's at least (of 8 rows x NEW_TOKENS), by dtype; these random tiny models leave
# few margins wider than bf16's error (the margins are the CPU's: the counts do not depend on the GPU).
MIN_CONFIDENT = {"float32": 150, "float16": 40, "bfloat16": 0}
RUN_FLAGS = ["--max-src-len", 96, "--max-len", 128, "--batch-size", 8, "--log-every", 1, "--eval-every", 1000,
             "--threads", 1, "--seed", 0]
STEPS = 8
METHOD_FLAGS = {"ptuning": ["--pre-seq-len", 4, "--prefix-projection", "--lr", "1e-2"],
                "lora": ["--lora-r", 4, "--lr", "1e-2"]}


# ---------------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module", autouse=True)
def full_fp32_matmuls():
    """fp32 matmuls in full fp32 on the GPU (no TF32) while these tests run, whatever a library switched on:
    the fp32 tolerances assume it."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cuda.matmul.allow_tf32 = before[0]
    torch.set_float32_matmul_precision(before[1])


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """name -> the directory of a random tiny base of that version (config.json, weights, tokenizer), made once."""
    made = {}

    def base(name: str) -> Path:
        if name not in made:
            directory = tmp_path_factory.mktemp(f"base-{name}")
            torch.manual_seed(0)
            model, _ = VERSIONS[name].tiny(CORPUS, directory)
            model.save_pretrained(directory)
            made[name] = directory
        return made[name]

    return base


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "eight.jsonl"
    path.write_text("\n".join(LINES[:8]) + "\n", encoding="utf-8")
    return path


def load(name: str, directory: Path, **kwargs):
    """(model in eval mode, tokenizer) of a base directory (`Version.load_model` arguments)."""
    version = VERSIONS[name]
    return version.load_model(directory, **kwargs).eval(), version.load_tokenizer(directory)


def prompts(tokenizer, n: int = 8) -> dict[str, torch.Tensor]:
    """A left-padded batch of the first `n` dev texts in the version's prompt (rows of different lengths)."""
    records = [SPORecord(text=json.loads(line)["text"], triples=None) for line in LINES[:n]]
    batch = collate_prompts([prompt_ids(r, tokenizer, ENCODING) for r in records], SpecialIds.of(tokenizer))
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 1, "the rows should differ in length (left padding)"
    return batch


@torch.no_grad()
def logits_of(model, batch: dict, device) -> torch.Tensor:
    """fp32 logits [n real positions, V] of the batch's real (unpadded) positions, on the CPU."""
    model.eval()
    out = model(**{k: v.to(device) for k, v in batch.items()}).logits.float().cpu()
    return out[batch["attention_mask"].bool()]


def dequantizing(model):
    """`model` with every QuantizedLinear on the dequantizing kernel (fp32 math on the CPU, as on the GPU)."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.kernel = "dequant"
    return model


def assert_logits_close(got: torch.Tensor, ref: torch.Tensor, dtype_name: str, what: str = "",
                        tolerance: float | None = None) -> None:
    """max |got - ref| <= the dtype's TOLERANCE (or `tolerance`) x the standard deviation of `ref`."""
    assert torch.isfinite(got).all(), f"{what}: non-finite logits"
    allowed = TOLERANCE[dtype_name] if tolerance is None else tolerance
    scale = ref.std().item()
    error = (got - ref).abs().max().item()
    assert error <= allowed * scale, (
        f"{what}: max logit error {error:.3g} = {error / scale:.3g} std, allowed {allowed} std ({dtype_name})")


@torch.no_grad()
def greedy_with_margins(model, batch: dict, new_tokens: int,
                        wide: float = 1e-4) -> tuple[list[list[int]], list[list[float]]]:
    """(greedy tokens of each row, the top-2 logit margin at each of its steps): `generate` on the model's device,
    and the margins from one forward over each row's prompt + tokens, which must pick the tokens the cached steps
    picked wherever its margin is at least `wide`."""
    tokens = generate(model, batch["input_ids"], batch["attention_mask"], max_new_tokens=new_tokens, eos_token_id=None)
    assert all(len(row) == new_tokens for row in tokens)
    device = next(model.parameters()).device
    margins = []
    for row, new in enumerate(tokens):
        real = batch["input_ids"][row][batch["attention_mask"][row].bool()]
        seq = torch.cat([real, torch.tensor(new[:-1], dtype=real.dtype)])[None].to(device)
        top = model(seq).logits[0, len(real) - 1 :].float().topk(2, dim=-1)
        margin = (top.values[:, 0] - top.values[:, 1]).tolist()
        picked = top.indices[:, 0].tolist()
        assert all(a == b or margin[t] < wide for t, (a, b) in enumerate(zip(picked, new))), \
            f"row {row}: the cached decoding {new} disagrees with a full forward {picked} (margins {margin})"
        margins.append(margin)
    return tokens, margins


def assert_same_where_confident(got, ref, margins, threshold: float, *, min_confident: int) -> int:
    """Each row of `got` equals `ref` up to the row's first margin below `threshold`; returns the tokens compared,
    at least `min_confident` (else the comparison would say nothing)."""
    compared = 0
    for row, (mine, theirs, m) in enumerate(zip(got, ref, margins)):
        k = next((t for t, value in enumerate(m) if value < threshold), len(m))
        assert mine[:k] == theirs[:k], f"row {row}: GPU {mine[:k]} != CPU {theirs[:k]} (margins {m[:k]})"
        compared += k
    assert compared >= min_confident, f"only {compared} confident tokens to compare (margins {margins})"
    return compared


def tensors_on(model, device_type: str) -> list[str]:
    """Names of the parameters and buffers of `model` that are NOT on `device_type`."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [n for n, t in named if t.device.type != device_type and t.numel()]


# ---------------------------------------------------------------------------------------------- logits, generate


@pytest.mark.parametrize("prefix", [False, True], ids=["plain", "ptuning"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("name", NAMES)
def test_logits_on_the_gpu_equal_fp32_on_the_cpu(name, dtype_name, prefix, bases):
    extra = {"pre_seq_len": 4} if prefix else {}
    torch.manual_seed(1)  # the fresh prefix encoder
    cpu, tokenizer = load(name, bases(name), **extra)
    batch = prompts(tokenizer)
    reference = logits_of(cpu, batch, "cpu")
    gpu = cpu.to(GPU, DTYPES[dtype_name])
    assert not tensors_on(gpu, "cuda")
    assert_logits_close(logits_of(gpu, batch, GPU), reference, dtype_name, f"{name} {dtype_name}")


@pytest.mark.parametrize("prefix", [False, True], ids=["plain", "ptuning"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_on_the_gpu_equals_the_cpu_where_the_margins_allow(name, dtype_name, prefix, bases):
    extra = {"pre_seq_len": 4} if prefix else {}
    torch.manual_seed(1)
    cpu, tokenizer = load(name, bases(name), **extra)
    batch = prompts(tokenizer)
    ref, margins = greedy_with_margins(cpu, batch, NEW_TOKENS)
    threshold = 2 * TOLERANCE[dtype_name] * logits_of(cpu, batch, "cpu").std().item()
    got, _ = greedy_with_margins(cpu.to(GPU, DTYPES[dtype_name]), batch, NEW_TOKENS, wide=threshold)
    assert_same_where_confident(got, ref, margins, threshold, min_confident=MIN_CONFIDENT[dtype_name])


# ---------------------------------------------------------------------------------------------- train.py on the GPU


@pytest.fixture(scope="module")
def runs(bases, data_file, tmp_path_factory):
    """(name, tuning, precision, bits) -> (run directory, the trained model as train.py left it on the GPU,
    logged losses): train.py in this process, each run made once."""
    made = {}

    def run(name: str, tuning: str, precision: str, bits: int = 0):
        key = (name, tuning, precision, bits)
        if key not in made:
            out = tmp_path_factory.mktemp(f"run-{name}-{tuning}-{precision}-int{bits}")
            captured = {}
            real_train = training.train

            def keep(model, *args, **kwargs):  # train.py's `run` looks `train` up when it runs
                captured["model"] = model
                return real_train(model, *args, **kwargs)

            quantized = ["--quantization-bit", bits] if bits else []
            argv = ["--model", bases(name), "--tuning", tuning, *METHOD_FLAGS[tuning], *quantized,
                    "--train-file", data_file, "--dev-file", data_file, "--mixed-precision", precision, "--max-steps",
                    STEPS, *RUN_FLAGS, "--output-dir", out]
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(training, "train", keep)
                # accelerate's state is one per process and keeps its first run's mixed precision: reset it
                # before each run, and after, for the tests that follow in this process
                AcceleratorState._reset_state(reset_partial_state=True)
                try:
                    code = train_cli.main([str(a) for a in argv])
                finally:
                    AcceleratorState._reset_state(reset_partial_state=True)
            assert code == 0, f"train.py {' '.join(map(str, argv))} exited with {code}"
            logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            made[key] = (out, captured["model"], [e["loss"] for e in logged if "loss" in e])
        return made[key]

    return run


def assert_learns(model, losses: list[float]) -> None:
    assert not tensors_on(model, "cuda"), "train.py did not train on the GPU"
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], f"the loss did not decrease: {losses}"


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("tuning", ["ptuning", "lora"])
@pytest.mark.parametrize("name", NAMES)
def test_train_py_steps_in_mixed_precision_on_the_gpu(name, tuning, precision, runs):
    out, model, losses = runs(name, tuning, precision)
    assert_learns(model, losses)
    assert rundir.has_trained_model(out)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", NAMES)
def test_train_py_qlora_on_an_int8_int4_base_on_the_gpu(name, bits, runs):
    out, model, losses = runs(name, "lora", "bf16", bits)
    assert_learns(model, losses)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.bits == bits and m.weight.device.type == torch.device(GPU).type for m in layers)
    assert loading.resolve_run(out).quantization_bit == bits


RUNS = [("ptuning", "bf16", 0), ("lora", "fp16", 0), ("lora", "bf16", 4)]


@pytest.mark.parametrize("tuning, precision, bits", RUNS, ids=["ptuning", "lora", "qlora-int4"])
@pytest.mark.parametrize("name", NAMES)
def test_a_run_trained_on_the_gpu_loads_on_the_cpu_with_the_same_outputs(name, tuning, precision, bits, runs):
    from accelerate.utils import extract_model_from_parallel

    out, model, _ = runs(name, tuning, precision, bits)
    loaded, tokenizer = loading.load_run(loading.resolve_run(out))
    assert not tensors_on(loaded, "cpu")
    batch = prompts(tokenizer)
    trained = extract_model_from_parallel(model, keep_fp32_wrapper=False)  # without accelerate's autocast wrapper
    try:
        expected = logits_of(trained.to("cpu"), batch, "cpu")
    finally:
        trained.to(GPU)  # as the other tests of the run find it
    torch.testing.assert_close(logits_of(loaded, batch, "cpu"), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tuning, precision, bits", RUNS, ids=["ptuning", "lora", "qlora-int4"])
@pytest.mark.parametrize("name", NAMES)
def test_a_run_loads_onto_the_gpu(name, tuning, precision, bits, runs):
    out = runs(name, tuning, precision, bits)[0]
    source = loading.resolve_run(out)
    gpu, tokenizer = loading.load_run(source, device=GPU)
    assert not tensors_on(gpu, "cuda"), f"left on another device: {tensors_on(gpu, 'cuda')}"
    cpu, _ = loading.load_run(source)
    batch = prompts(tokenizer)
    assert_logits_close(logits_of(gpu, batch, GPU), logits_of(dequantizing(cpu), batch, "cpu"), "float32",
                        f"{name} {tuning} run")


@pytest.mark.parametrize("tuning", ["ptuning", "lora"])
@pytest.mark.parametrize("name", NAMES)
def test_infer_py_runs_a_run_on_the_gpu(name, tuning, runs, data_file, tmp_path, capsys):
    out = runs(name, tuning, "bf16")[0]
    common = ["--model", out, "--input", data_file, "--batch-size", 8]
    infer_cli.main([str(a) for a in [*common, "--device", "cuda", "--output", tmp_path / "half.jsonl"]])
    assert ", cuda" in capsys.readouterr().err  # its model line: float16 (the CUDA default), cuda
    half = [json.loads(line) for line in (tmp_path / "half.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(half) == 8 and all(row["new_tokens"] >= 1 for row in half)
    rows = {}
    for device in ("cuda", "cpu"):
        path = tmp_path / f"fp32-{device}.jsonl"
        infer_cli.main([str(a) for a in [*common, "--device", device, "--dtype", "float32", "--output", path]])
        rows[device] = [json.loads(line)["generated"] for line in path.read_text(encoding="utf-8").splitlines()]
    same = sum(a == b for a, b in zip(rows["cuda"], rows["cpu"]))
    assert same >= 6, f"fp32 on the GPU and the CPU agree on only {same} of 8 records: {rows}"


# ---------------------------------------------------------------------------------------------- INT8 / INT4


def integers(layer: QuantizedLinear) -> torch.Tensor:
    return (unpack_int4(layer.weight) if layer.bits == 4 else layer.weight).cpu().int()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", NAMES)
def test_quantize_model_on_the_gpu_holds_the_cpus_integers_and_decodes_as_it(name, bits, bases):
    version = VERSIONS[name]
    cpu, tokenizer = load(name, bases(name))
    gpu = load(name, bases(name))[0].to(GPU)
    dequantizing(quantize_model(cpu, bits, targets=version.quantizable_linears))
    quantize_model(gpu, bits, targets=version.quantizable_linears)
    mine = {n: m for n, m in gpu.named_modules() if isinstance(m, QuantizedLinear)}
    theirs = {n: m for n, m in cpu.named_modules() if isinstance(m, QuantizedLinear)}
    assert mine.keys() == theirs.keys() and mine
    for n, layer in mine.items():
        assert layer.weight.device.type == torch.device(GPU).type and layer.weight.dtype == torch.int8, n
        # identical but for a scale that rounds to its neighbour fp16 value (a GPU division by a scalar multiplies
        # by its reciprocal), which moves an integer by at most one
        torch.testing.assert_close(layer.weight_scale.cpu(), theirs[n].weight_scale, rtol=1e-3, atol=0)
        assert (integers(layer) - integers(theirs[n])).abs().max() <= 1, n
        assert (integers(layer) == integers(theirs[n])).float().mean() > 0.99, n
    batch = prompts(tokenizer)
    reference = logits_of(cpu, batch, "cpu")
    # fp32 on both; 1e-3 std leaves room for a scale one fp16 step apart
    assert_logits_close(logits_of(gpu, batch, GPU), reference, "float32", f"{name} INT{bits}", tolerance=1e-3)
    gpu.half()
    assert_logits_close(logits_of(gpu, batch, GPU), reference, "float16", f"{name} INT{bits} fp16")
    assert all(m.weight_scale.dtype == torch.float16 and m.last_kernel == "intmm" for m in mine.values())
    threshold = 2 * TOLERANCE["float16"] * reference.std().item()
    ref, margins = greedy_with_margins(cpu, batch, NEW_TOKENS)
    got, _ = greedy_with_margins(gpu, batch, NEW_TOKENS, wide=threshold)
    assert_same_where_confident(got, ref, margins, threshold, min_confident=MIN_CONFIDENT["float16"])


@pytest.mark.parametrize("embedding", [False, True], ids=["blocks", "blocks+embedding"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name", NAMES)
def test_the_loader_quantizes_onto_the_gpu(name, bits, embedding, bases):
    """`load_model(quantization_bit=..., device="cuda")` (fp16, as infer.py on CUDA) against the same integers in
    fp32 on the CPU; greedy tokens where the margins allow."""
    options = dict(quantization_bit=bits, quantize_embedding=embedding, dtype=torch.float16)
    gpu, tokenizer = load(name, bases(name), device=GPU, **options)
    assert not tensors_on(gpu, "cuda") and gpu.config.quantization_bit == bits
    cpu = dequantizing(load(name, bases(name), **options)[0].float())
    batch = prompts(tokenizer)
    reference = logits_of(cpu, batch, "cpu")
    assert_logits_close(logits_of(gpu, batch, GPU), reference, "float16", f"{name} INT{bits} loaded")
    threshold = 2 * TOLERANCE["float16"] * reference.std().item()
    ref, margins = greedy_with_margins(cpu, batch, NEW_TOKENS)
    got, _ = greedy_with_margins(gpu, batch, NEW_TOKENS, wide=threshold)
    assert_same_where_confident(got, ref, margins, threshold, min_confident=MIN_CONFIDENT["float16"])


# ---------------------------------------------------------------------------------------------- weight-only kernels


# (bits, group size, x dtype) -> the kernel "auto" runs on the GPU without a gradient, and its error bound relative to
# float64 (bf16 / fp16 activations and outputs: their rounding; the dequantizing path's own error is of that size)
KERNEL_CASES = {(8, 0, "bfloat16"): ("intmm", 1e-2), (8, 0, "float16"): ("intmm", 2e-3),
                (8, 0, "float32"): ("intmm", 1e-5), (4, 0, "bfloat16"): ("int4mm", 1e-2),
                (4, 0, "float16"): ("intmm", 2e-3), (4, 0, "float32"): ("intmm", 1e-5),
                (4, 64, "bfloat16"): ("int4mm", 1e-2), (4, 64, "float16"): ("dequant", 2e-3)}


@pytest.mark.parametrize("bits, group_size, dtype_name", list(KERNEL_CASES))
def test_the_weight_only_kernels_compute_the_dequantized_matmul(bits, group_size, dtype_name):
    """`QuantizedLinear` on the GPU, rows 1, 7 and 40 of x: the kernel "auto" picks, within its dtype's rounding of the
    float64 product with the dequantized weight; a weight held in tinygemm's layout (int4mm releases the official one)
    reads back exactly: state_dict, the dequantizing path, and a move to the CPU."""
    kernel, bound = KERNEL_CASES[bits, group_size, dtype_name]
    torch.manual_seed(0)
    dense = torch.nn.Linear(384, 200, bias=True)
    layer = QuantizedLinear.from_linear(dense, bits, group_size).to(GPU, DTYPES[dtype_name])
    official = layer.weight.detach().clone()
    exact = (unpack_int4(official) if bits == 4 else official).double().view(200, -1, group_size or 384)
    exact = (exact * layer.weight_scale.double().view(200, -1, 1)).view(200, 384)
    for rows in (1, 7, 40):
        x = torch.randn(rows, 384, device=GPU, dtype=DTYPES[dtype_name])
        with torch.no_grad():
            y = layer(x)
        assert layer.last_kernel == kernel and y.dtype == x.dtype and y.shape == (rows, 200)
        ref = x.double() @ exact.T + layer.bias.double()
        error = ((y.double() - ref).norm() / ref.norm()).item()
        assert error < bound, f"{kernel}: relative error {error:.2g} at {rows} rows"
    if kernel == "int4mm":
        assert layer.held_layout == "int4mm" and layer.weight.numel() == 0
        assert torch.equal(layer.state_dict()["weight"], official)
        layer.kernel = "dequant"
        with torch.no_grad():
            torch.testing.assert_close(layer(x).double(), ref, rtol=bound, atol=bound * ref.abs().max().item())
        assert torch.equal(layer.to("cpu").weight, official.cpu())


COMPILED_CASES = {"float32": ("float32", 0), "int8 float32": ("float32", 8), "int4 bfloat16": ("bfloat16", 4)}


@pytest.mark.parametrize("case", list(COMPILED_CASES))
def test_compiled_decoding_on_the_gpu_gives_the_cached_loops_ids(case, bases):
    """`generate(compiled=True)` on the GPU (a static cache, the steps captured as CUDA graphs; INT8 / INT4 through
    their weight-only kernels) against the cached loop of the same model, a left-padded batch with a P-tuning
    prefix: the same tokens up to each row's first margin narrower than twice the dtype's tolerance."""
    dtype_name, bits = COMPILED_CASES[case]
    torch.manual_seed(1)
    model, tokenizer = load("chatglm3", bases("chatglm3"), pre_seq_len=4)
    model = model.to(GPU, DTYPES[dtype_name])
    if bits:
        quantize_model(model, bits, targets=VERSIONS["chatglm3"].quantizable_linears)
    batch = prompts(tokenizer)
    threshold = 2 * TOLERANCE[dtype_name] * logits_of(model, batch, GPU).std().item()
    ref, margins = greedy_with_margins(model, batch, NEW_TOKENS, wide=threshold)
    got = generate(model, batch["input_ids"].to(GPU), batch["attention_mask"].to(GPU), max_new_tokens=NEW_TOKENS,
                   eos_token_id=None, compiled=True)
    assert_same_where_confident(got, ref, margins, threshold,
                                min_confident=MIN_CONFIDENT[dtype_name] if not bits else 0)
    kernels = {m.last_kernel for m in model.modules() if isinstance(m, QuantizedLinear)}
    assert kernels == ({"intmm"} if bits == 8 else {"int4mm"} if bits else set()), kernels


# ---------------------------------------------------------------------------------------------- bitsandbytes


@pytest.mark.parametrize("mode, tolerance", [("int8", 0.1), ("nf4", 0.5)])
@pytest.mark.parametrize("name", NAMES)
def test_a_bitsandbytes_base_runs_generates_and_trains_lora(name, mode, tolerance, bases):
    """`to_bitsandbytes` (LLM.int8() / NF4 Linears, quantized on the GPU) under fp16 compute: logits within a
    relative error of the float model's (the bound says 'the same model', not a precision figure), greedy decoding,
    and a LoRA step with gradients on the adapters only."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install 'chatglm_tune[bnb]')")
    from chatglm_tune.quant.apply import to_bitsandbytes

    version = VERSIONS[name]
    model, tokenizer = load(name, bases(name), dtype=torch.float16, device=GPU)
    batch = prompts(tokenizer)
    reference = logits_of(model, batch, GPU)
    to_bitsandbytes(model, mode, targets=version.quantizable_linears)
    got = logits_of(model, batch, GPU)
    assert torch.isfinite(got).all()
    relative = ((got - reference).norm() / reference.norm()).item()
    assert relative < tolerance, f"{name} bitsandbytes {mode}: relative logit error {relative:.3f}"
    new = generate(model, batch["input_ids"], batch["attention_mask"], max_new_tokens=8, eos_token_id=None)
    assert all(len(row) == 8 for row in new)
    tuned = apply_lora(model, LoraOptions(r=4, target=version.lora_targets))
    tuned.train()
    records = read_records(DEV)[0][:4]
    train_batch = collate_train([encode_record(r, tokenizer, ENCODING) for r in records], SpecialIds.of(tokenizer))
    with torch.autocast("cuda", dtype=torch.float16):
        loss = tuned(**{k: v.to(GPU) for k, v in train_batch.items()}).loss
    loss.backward()
    assert torch.isfinite(loss)
    trainable = [(n, p) for n, p in tuned.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, _ in trainable)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for _, p in trainable)
