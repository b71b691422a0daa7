"""chatglm_tune: fine-tune ChatGLM / GLM (ChatGLM-6B to GLM-4.7-Flash) with P-tuning v2, LoRA or fully; run them in
half, INT8 and INT4.

`chatglm_tune.from_pretrained(dir)` / `chatglm_tune.load_tokenizer(dir)` load any version.

After `import chatglm_tune`, transformers' Auto classes load every version's directory (`model_type: chatglm`)
without `trust_remote_code`, yet the import itself reads neither torch nor transformers, so every command's
`--help` answers at once. The registration (`auto`) imports both; it happens at first use. The moment
transformers' AutoConfig is imported (now, if it already is), a stand-in for `model_type: chatglm` is registered
with it; reading such a config, which AutoModel, AutoTokenizer and peft's Auto classes all do first, imports `auto`,
which registers every class in the stand-in's place. The public names below are imported when first used, and
register too.

The modules that sat at the package's root before they moved into rooms (subpackages: loading into `runs`, ...;
the table `_MOVED`) still import under their old names, as the very same module objects (`_Moved`).
"""

import importlib
import importlib.abc
import importlib.util
import sys

_PUBLIC = {
    "ChatGLMConfig": ".models.chatglm6b.config",
    "ChatGLMForConditionalGeneration": ".models.chatglm6b.modeling",
    "ChatGLMModel": ".models.chatglm6b.modeling",
    "ChatGLMTokenizer": ".models.chatglm6b.tokenizer",
    "generate": ".decoding.generation",
    "from_pretrained": ".runs.loading",
    "load_tokenizer": ".models.registry",
}
__all__ = sorted(_PUBLIC)
# Old name under the package -> the module's path in its room now. `import chatglm_tune.loading`, `from chatglm_tune
# import loading` and a pickle naming `chatglm_tune.loading.X` keep working (`_Moved`).
_MOVED = {
    **{name: f"runtime.{name}" for name in ("heap", "openmp", "cores", "crashpoints", "leftovers", "stopping",
                                            "checkpoint")},
    **{name: f"data.{name}" for name in ("records", "dialogues", "batches", "tokenizing")},
    **{name: f"models.{name}" for name in ("prefix", "loss")},
    **{name: f"tuning.{name}" for name in ("training", "curves")},
    **{name: f"evaluation.{name}" for name in ("metrics", "textmetrics", "callmetrics", "extraction", "shards")},
    **{name: f"runs.{name}" for name in ("loading", "rundir", "lora", "auto")},
}
# AutoConfig's module: AutoModel's, AutoTokenizer's and the others' all import it first.
_AUTO_CONFIG = "transformers.models.auto.configuration_auto"


def __getattr__(name: str):
    if name in _MOVED:  # `chatglm_tune.loading` after `import chatglm_tune`: the moved module, imported
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _registered()
    return getattr(importlib.import_module(_PUBLIC[name], __name__), name)


def _registered():
    """The `auto` module, imported: every class registered with transformers' Auto classes."""
    from chatglm_tune.runs import auto

    return auto


def _register_stand_in() -> None:
    """`model_type: chatglm` in AutoConfig as a stand-in that hands over to `auto` at its first use (reading a
    config: `AutoConfig.from_pretrained`, `for_model`). A registration already made by `auto` stays."""
    if "chatglm_tune.runs.auto" in sys.modules:
        return
    from transformers.configuration_utils import PreTrainedConfig
    from transformers.models.auto.configuration_auto import AutoConfig

    class ChatGLMConfigStandIn(PreTrainedConfig):
        model_type = "chatglm"

        def __new__(cls, *args, **kwargs):
            return _registered().AnyChatGLMConfig(*args, **kwargs)

        @classmethod
        def from_dict(cls, config_dict: dict, **kwargs):
            return _registered().AnyChatGLMConfig.from_dict(config_dict, **kwargs)

    AutoConfig.register("chatglm", ChatGLMConfigStandIn, exist_ok=True)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then()` right after the module `name` is first imported, before the import that asked for it
    returns; the module keeps its own loader, and this finder leaves `sys.meta_path` once it has run."""

    def __init__(self, name: str, then):
        self.name, self.then, self.finding = name, then, False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self.finding:
            return None
        self.finding = True
        try:
            spec = importlib.util.find_spec(fullname)  # as the other finders find it
        finally:
            self.finding = False
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """A module's own loader, then its `_AfterImport` hook's `then()`."""

    def __init__(self, loader, hook: _AfterImport):
        self.loader, self.hook = loader, hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        if self.hook in sys.meta_path:
            sys.meta_path.remove(self.hook)
        self.hook.then()


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `chatglm_tune.<old>` for a module that moved into a room (`_MOVED`) and loads it as the module of its
    new path, imported there: one module object under both names in `sys.modules`, its `__name__` and `__spec__`
    the new path's. Any other name is left to the other finders (an unknown one stays a ModuleNotFoundError)."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{_MOVED[spec.name.rpartition('.')[2]]}")
        spec.loader_state = module.__spec__  # the import system sets `module.__spec__ = spec` next: put back then
        return module

    def exec_module(self, module) -> None:
        if module.__spec__.loader is self:  # ran already under its new name: only its own spec to restore
            module.__spec__ = module.__spec__.loader_state


sys.meta_path[:] = [f for f in sys.meta_path if type(f).__qualname__ != "_Moved" or type(f).__module__ != __name__]
sys.meta_path.insert(0, _Moved())

if _AUTO_CONFIG in sys.modules:
    _register_stand_in()
else:
    sys.meta_path.insert(0, _AfterImport(_AUTO_CONFIG, _register_stand_in))
