"""What a model folder's genai_config.json may not choose: native code to load, files to write.

onnxruntime-genai builds each ONNX Runtime session it opens from a ``session_options`` object of
the config (the decoder's, and the encoder's, embedding's, vision and speech models', pipeline
stages', ...: onnxruntime-genai 0.18's src/config.cpp and src/models/model.cpp). Through it a
stranger's folder could make the process that opens the folder:

- load a shared library: ``custom_ops_library`` (``dlopen``: its constructors run at once, before
  onnxruntime-genai looks for the custom ops in it);
- hand an execution provider options that name libraries, files or memory addresses (QNN's
  ``backend_path``, TensorRT's ``trt_extra_plugin_lib_paths``, CUDA's ``gpu_external_alloc`` and
  ``user_compute_stream``, engine cache folders, ...): ``provider_options``;
- write files or read other folders: ``enable_profiling`` (a profile at the path prefix it gives),
  and session config entries (every key onnxruntime-genai does not know is handed to ONNX Runtime's
  ``AddConfigEntry``: ``ep.context_file_path`` writes a model there,
  ``session.model_external_initializers_file_folder_path`` reads weights from a folder), and run
  options (run config entries, the same open set).

:func:`strip_native` keeps only what is known to be none of these: the session options that are
numbers, flags or names (threads, arenas, log ids and levels, the optimization level), a few
session config entries that are flags, and provider options that are the tuning flags the model
builder writes. Everything else under ``session_options``, ``provider_options`` and
``run_options`` is dropped and named. A ``custom_ops_library`` stays only where ``keep_library``
says so (``graphcal bench --allow-custom-ops PATH``); ``run`` keeps none in -o's copy.
Imports nothing of graphcal's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

LIBRARY = "custom_ops_library"
#: session options onnxruntime-genai reads as numbers, flags or a name (never a path)
SAFE_SESSION_OPTIONS = frozenset({"intra_op_num_threads", "inter_op_num_threads", "enable_cpu_mem_arena",
                                  "enable_mem_pattern", "log_id", "log_severity_level", "log_verbosity_level",
                                  "graph_optimization_level"})
#: ONNX Runtime session config entries that are flags
SAFE_CONFIG_ENTRIES = frozenset({"session.intra_op.allow_spinning", "session.inter_op.allow_spinning",
                                 "session.set_denormal_as_zero", "session.disable_prepacking"})
#: provider options that are tuning flags (those onnxruntime-genai's model builder writes, and a few of CUDA's);
#: device_filtering_options picks a device by type and id
SAFE_PROVIDER_OPTIONS = frozenset({"enable_cuda_graph", "enable_graph_capture", "enableGraphCapture", "validationMode",
                                   "multiRotaryCacheConcatOffset", "multi_rotary_cache_concat_offset",
                                   "enable_skip_layer_norm_strict_mode", "prefer_nhwc", "use_tf32",
                                   "device_filtering_options"})


@dataclass(frozen=True)
class Stripped:
    """A genai_config without what could load code or write files, and what was taken out."""

    config: dict
    dropped: tuple[str, ...]  # the dotted names of what was dropped (model.decoder.session_options.custom_ops_library)
    libraries: tuple[tuple[str, str], ...]  # (dotted name, value) of every custom_ops_library, kept or dropped

    def describe(self, most: int = 6) -> str:
        """The dropped names for one line: the first ``most``, then how many more."""
        names = list(self.dropped[:most]) + ([f"and {len(self.dropped) - most} more"] if len(self.dropped) > most else [])
        return ", ".join(names)


def strip_native(config: dict, keep_library: Callable[[str], str | None] = lambda value: None) -> Stripped:
    """A copy of the parsed genai_config ``config`` with only what cannot load code or write files in its
    session, provider and run options (see the module's doc). ``keep_library(value)`` gives the value a
    ``custom_ops_library`` is kept with, or None to drop it (the default: every one is dropped)."""
    dropped: list[str] = []
    libraries: list[tuple[str, str]] = []

    def library(value, where: str):
        libraries.append((where, value if isinstance(value, str) else repr(value)))
        kept = keep_library(value) if isinstance(value, str) else None
        if kept is None:
            dropped.append(where)
        return kept

    def providers(value, where: str):
        if not isinstance(value, list):
            dropped.append(where)
            return None
        out = []
        for i, entry in enumerate(value):
            if not isinstance(entry, dict):
                dropped.append(f"{where}[{i}]")
                continue
            kept_entry = {}
            for name, options in entry.items():
                if not isinstance(options, dict):
                    dropped.append(f"{where}[{i}].{name}")
                    continue
                kept_entry[name] = {}
                for key, option in options.items():
                    if key in SAFE_PROVIDER_OPTIONS:
                        kept_entry[name][key] = option
                    else:
                        dropped.append(f"{where}[{i}].{name}.{key}")
            out.append(kept_entry)
        return out

    def session(value: dict, where: str) -> dict:
        out = {}
        for key, item in value.items():
            at = f"{where}.{key}"
            if key == LIBRARY:
                kept = library(item, at)
                if kept is not None:
                    out[key] = kept
            elif key == "provider_options":
                kept = providers(item, at)
                if kept is not None:
                    out[key] = kept
            elif key in SAFE_SESSION_OPTIONS or key in SAFE_CONFIG_ENTRIES:
                out[key] = item
            else:  # enable_profiling, and every session config entry not known to be a flag
                dropped.append(at)
        return out

    def walk(value, where: str):
        if isinstance(value, list):
            return [walk(item, f"{where}[{i}]") for i, item in enumerate(value)]
        if not isinstance(value, dict):
            return value
        out = {}
        for key, item in value.items():
            at = f"{where}.{key}" if where else key
            if key == "session_options" and isinstance(item, dict):
                out[key] = session(item, at)
            elif key == "run_options" and isinstance(item, dict):
                dropped.extend(f"{at}.{k}" for k in item)
                out[key] = {}
            elif key == "provider_options":
                kept = providers(item, at)
                if kept is not None:
                    out[key] = kept
            elif key == LIBRARY:
                kept = library(item, at)
                if kept is not None:
                    out[key] = kept
            else:
                out[key] = walk(item, at)
        return out

    return Stripped(walk(config, ""), tuple(dropped), tuple(libraries))
