"""Every hook of mlx-lm-ext, in one place (pluggy project name ``mlx_lm_ext``).

A plugin is a module (or object) named by an entry point in the group
``mlx_lm_ext.plugins``; the entry point's name is the plugin's name, the one
users type after ``--plugin``. Its hooks are plain functions decorated with
``hookimpl`` from ``mlx_lm_ext.api`` (the plugin API: everything of the core a
plugin may use); a plugin implements only the hooks it needs.

A plugin is imported and registered only when a user names it
(``--plugin NAME``, ``--loss NAME``, ``loss: NAME`` in a lora YAML config, or
``mlx_lm_ext.enable(NAME)``), so an installed plugin that is not named changes
nothing. The exceptions are ``add_subcommands`` and ``doctor``, which the
``mlx-lm-ext`` command calls on every installed plugin, and ``commands``,
``add_arguments`` and ``loss_names``, read from a plugin's module without
registering it: to say which plugin owns a flag given without its
``--plugin`` (``plugins.flag_owner``) and which provides a ``--loss``.

``command`` is one of ``"generate"``, ``"server"``, ``"lora"`` (mlx-lm's
commands) or ``"python"`` (``mlx_lm_ext.enable`` from user code).

How the host calls a hook: pluggy is the registry only. It finds a
plugin's implementations and checks their argument names against these
specs when the plugin is registered; the host then calls them itself, in
``plugins.py``, and never through pluggy's ``pm.hook.NAME(...)``:

* ``plugins.first(NAME, ...)`` for the hooks in ``FIRST_RESULT`` below: the
  first non-``None`` result among the active plugins, in activation order
  (what pluggy's ``firstresult`` would mean, but pluggy's own call order is
  last registered first);
* ``plugins.collect(NAME, ...)``: every active plugin's non-``None``
  result; a plugin that raises loses only its own result (logged with its
  name);
* ``plugins.each(NAME, ...)``: ``{plugin: result or the exception}``, for
  callers that report per plugin (the status page's ``metrics``,
  ``status_charts``, ``status_options``);
* ``plugins.call(plugin, NAME, ...)``: one plugin's own implementation
  (``activate``, ``add_arguments``, ``doctor``, ...).

Each call hands every plugin the options its own ``activate`` returned, as
``options`` when its implementation takes that argument, and asks only the
plugins active in this process (a plugin is registered, not yet active,
while its flags are read). A single ``pm.hook.NAME(...)`` call can do
neither: it passes one set of arguments to every registered plugin and
stops at the first exception.

Errors: raise ``mlx_lm_ext.api.PluginError`` for bad user input (the host prints
the message and exits with status 2); any other exception from ``activate``
is reported as a failed activation (exit 1) without a traceback from inside
mlx-lm. Hooks that run while a server is serving (prompt cache, drafter) must
not raise for I/O trouble: degrade and log instead.
"""

import argparse
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pluggy

hookspec = pluggy.HookspecMarker("mlx_lm_ext")

# The hooks the host asks with ``plugins.first`` (one answer wanted); every
# other hook is asked with ``collect``, ``each`` or ``call``.
FIRST_RESULT = frozenset(
    {
        "make_prompt_cache",
        "make_drafter",
        "speculative_generate_step",
        "batch_generator",
        "make_loss",
        "load_dataset",
        "iterate_batches",
    }
)


@hookspec
def commands() -> List[str]:
    """Return the commands this plugin extends, e.g. ``["server"]``.

    Used by ``mlx-lm-ext plugins`` and to refuse a plugin named on a command
    it does not extend.
    """


@hookspec
def add_arguments(command: str, group: argparse._ArgumentGroup) -> None:
    """Add this plugin's flags for ``command`` to ``group``.

    ``group`` is an ``argparse`` argument group titled after the plugin, so
    the flags show in ``--help`` on their own. Defaults must be JSON
    serialisable (lora writes all arguments to ``adapter_config.json``); for
    ``lora`` every default must be ``None`` and the real default applied in
    ``activate`` (lora fills ``None`` values from its YAML config).
    """


@hookspec
def activate(command: str, args: argparse.Namespace) -> Any:
    """Turn the plugin on for ``command`` with the parsed arguments ``args``.

    Called once per process after parsing (for lora: after the YAML merge),
    before mlx-lm loads a model. Validate options here and raise
    ``PluginError`` with a clear message for bad ones. Return the validated
    options (any object, or None): the host hands them back to this plugin
    as ``options`` in ``make_prompt_cache``, ``make_drafter``, ``make_loss``
    and the other hooks that take it.
    """


@hookspec
def deactivate() -> None:
    """Undo ``activate`` (``mlx_lm_ext.disable``); restore what was patched."""


@hookspec
def make_prompt_cache(
    args: Optional[argparse.Namespace], options: Any, max_size: int, max_bytes: int
) -> Any:
    """Return the server's prompt cache, or ``None`` to leave it alone.

    Called where ``mlx_lm.server`` builds ``LRUPromptCache(max_size,
    max_bytes)`` (both with the class's defaults when left out); the result
    must be an ``mlx_lm.models.cache.LRUPromptCache``. ``args`` is the
    server's parsed command line (or the plugin's options when enabled from
    Python). If this hook raises, the server keeps the stock cache and logs a
    warning.
    """


@hookspec
def model_loaded(
    command: str, model_key: Any, model: Any, draft_model: Any, tokenizer: Any
) -> None:
    """A model was loaded: ``mlx_lm.server`` (at start-up or for a request).

    ``model_key`` is the server's key ``(model, adapter, draft model)``, the
    one its prompt cache is called with; ``draft_model`` is mlx-lm's own
    ``--draft-model`` (an ``nn.Module``) or ``None``. Must not raise: a
    plugin that fails here logs and carries on.
    """


@hookspec
def prompt_cache_classes() -> List[type]:
    """Return the cache classes this plugin appends to prompt cache lists.

    A plugin whose state rides in the prompt cache after the model's own
    caches (a drafter's n-gram index, say) lists the classes here, so that a
    plugin that stores prompt caches can store and rebuild them. Each class
    has ``state`` and ``meta_state`` and a ``from_state(state, meta_state)``
    that validates what it is given (it may come from an untrusted file).
    """


@hookspec
def make_drafter(
    command: str,
    model: Any,
    tokenizer: Any,
    draft_model: Any,
    args: Optional[argparse.Namespace],
    options: Any,
) -> Any:
    """Return a drafter for speculative decoding, or ``None``.

    Called once the target model (and mlx-lm's own ``--draft-model``, passed
    as ``draft_model`` or ``None``) is loaded, in ``mlx_lm.generate`` and in
    ``mlx_lm.server``. In ``generate`` the host passes it to mlx-lm's
    ``generate`` as ``draft_model``; in the server it goes to the batched
    path when ``batch_generator`` takes it, else it becomes the model
    provider's draft model (serving then runs one request at a time) and
    reaches ``speculative_generate_step`` below. From Python (``command``
    ``"python"``, ``args`` None: the plugin reads its ``options``) it is
    asked at each ``stream_generate`` call, with the call's own
    ``draft_model``; ``None`` keeps that one as it is.
    """


@hookspec
def speculative_generate_step(
    prompt: Any, model: Any, drafter: Any, kwargs: Dict[str, Any]
) -> Optional[Iterator[Tuple[int, Any, bool]]]:
    """Return a generator for mlx-lm's speculative path, or ``None``.

    Called for every call of ``mlx_lm.generate.speculative_generate_step``
    (``stream_generate`` with a draft model). ``drafter`` is what mlx-lm was
    given as its draft model: the drafter the host got from ``make_drafter``
    and handed to mlx-lm, or a plain ``nn.Module`` draft model. ``kwargs``
    holds the rest of that call (``stream``, ``num_draft_tokens``,
    ``max_tokens``, ``sampler``, ``logits_processors``, ``prompt_cache``,
    ...). The generator must yield ``(token: int, logprobs: mx.array[V],
    from_draft: bool)`` as mlx-lm's does. Return ``None`` for a drafter this
    plugin does not handle, and mlx-lm's own implementation runs.
    """


@hookspec
def batch_generator(
    model: Any,
    tokenizer: Any,
    drafter: Any,
    args: Optional[argparse.Namespace],
    options: Any,
) -> Optional[Callable[..., Any]]:
    """Return a factory for the server's batched path with ``drafter``, or ``None``.

    Called in ``mlx_lm.server`` after ``make_drafter`` gave ``drafter``, when
    the model's caches can be batched. The factory is called where the
    server builds its ``BatchGenerator``, as ``factory(model, **kwargs)``
    (``completion_batch_size``, ``prefill_batch_size``, ``prefill_step_size``,
    ``stream``), and returns an object with ``BatchGenerator``'s interface
    (``insert_segments``, ``next``, ``remove``, ``extract_cache``,
    ``prompt_cache_nbytes``, ``close``). Inside its ``insert_segments``,
    ``mlx_lm_ext.api.request_info()`` is the dict of the request being
    inserted. With ``None`` the server serves the drafter one request at a
    time (``speculative_generate_step``). If the hook or the factory raises,
    the host logs it and the server keeps mlx-lm's own.
    """


@hookspec
def make_loss(name: str, model: Any, args: argparse.Namespace, options: Any) -> Optional[Callable]:
    """Return a training loss for ``--loss name``, or ``None``.

    The loss has mlx-lm's ``default_loss(model, batch, lengths)`` signature
    (``loss(model, *batch)`` with the plugin's ``iterate_batches``) and
    returns ``(mean_loss, ntokens)``. It is used for training and evaluation
    in ``mlx_lm.lora`` and must work inside the compiled step. A loss with a
    ``metrics`` attribute (a tuple of names) returns ``(mean_loss, ntokens,
    values)`` instead, ``values`` a ``[len(metrics)]`` array of the batch's
    means: the host averages them over the batches of each report and prints
    them beside mlx-lm's train, validation and test lines
    (``mlx_lm_ext/training.py``).
    """


@hookspec
def loss_names() -> List[str]:
    """Return the ``--loss`` names this plugin provides besides its own name.

    E.g. ``["orpo", "dpo"]``: ``mlx_lm.lora --loss orpo`` (or ``loss: orpo``
    in the YAML) then activates this plugin and calls ``make_loss`` with
    ``name="orpo"``. Read from the plugin's module without registering it
    (``plugins.loss_provider``), like ``commands``.
    """


@hookspec
def load_dataset(
    name: str, args: argparse.Namespace, tokenizer: Any, options: Any
) -> Optional[Tuple[Any, Any, Any]]:
    """Return ``(train, valid, test)`` datasets for ``--loss name``, or ``None``.

    Called where ``mlx_lm.lora`` loads its data (``load_dataset(args,
    tokenizer)`` in ``run``, after the model is loaded), for a loss whose rows
    are not mlx-lm's formats. Each dataset is what mlx-lm's ``CacheDataset``
    wraps: ``len``, ``[i]`` and ``process(row)``. Raise ``PluginError`` for a
    bad row, naming its file and line (exit 2). ``None``: mlx-lm's own loader.
    """


@hookspec
def iterate_batches(name: str, args: argparse.Namespace, options: Any) -> Optional[Callable]:
    """Return the batch iterator for ``--loss name``, or ``None`` for mlx-lm's.

    It has ``mlx_lm.tuner.trainer.iterate_batches``'s signature
    ``(dataset, batch_size, max_seq_length, loop=False, seed=None,
    comm_group=None)`` and yields tuples of arrays; the loss gets each tuple
    as ``loss(model, *batch)``. Used for training, validation and ``--test``.
    """


@hookspec
def usage_fields(info: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Return fields to merge into a server response's ``usage``, or ``None``.

    ``info`` is the request's dict from ``mlx_lm_ext.api.request_info()``,
    where plugins recorded what they did while the request was generated.
    A plugin that raises costs only its own fields.
    """


@hookspec
def report_lines(command: str, source: Any) -> Optional[List[str]]:
    """Return lines to add to mlx-lm's own report, or ``None``.

    ``command == "generate"``: printed after ``mlx_lm.generate --verbose``'s
    figures; ``source`` is the request's info dict. ``command == "server"``:
    logged after the server's "Prompt Cache: ..." lines; ``source`` is the
    server's prompt cache.
    """


@hookspec
def request_finished(info: Dict[str, Any]) -> None:
    """A server request ended (answered, failed, or its client went away).

    ``info`` is the request's dict (see ``usage_fields``; empty when the
    request never reached generation). Called on the request's HTTP handler
    thread, after the response was written: a plugin folds the request's
    figures into the totals its ``metrics`` reports. Must be cheap; a plugin
    that raises costs only itself. Only while the status routes are on
    (``--no-status`` turns them off).
    """


@hookspec
def metrics(prompt_cache: Any, options: Any) -> Optional[List[Any]]:
    """Return this plugin's series for ``GET /metrics`` and ``/status``, or ``None``.

    A list of ``prometheus_client`` metric families
    (``prometheus_client.core.CounterMetricFamily``, ``GaugeMetricFamily``,
    ``HistogramMetricFamily``), built fresh on each call from the plugin's
    own counters. Names start with the plugin's prefix (``mlx_lm_ssd_cache_``)
    and must not repeat the host's (``mlx_lm_``...). ``prompt_cache`` is the
    server's prompt cache (what ``make_prompt_cache`` returned, or mlx-lm's
    own). Called on an HTTP handler thread or the status sampler thread, so
    read shared counters under the plugin's own lock. A plugin that raises,
    or returns something that is not a list of families, loses only its own
    series (the page shows why); the host's series and other plugins' stay.
    """


@hookspec
def status_options(args: argparse.Namespace, options: Any) -> Optional[Dict[str, Any]]:
    """Return this plugin's effective option values for ``/status``, or ``None``.

    ``{dest: value}``, ``dest`` a flag's ``argparse`` name (``"draft_max"``
    for ``--draft-max``): what a flag left at its default resolved to once
    active (``--drafter`` unset runs ``"ngram"``; ``--draft-max`` unset is
    10 for it). The page lists each of the plugin's flags with its parsed
    value, these replacing it; a name that is none of the plugin's flags
    is shown as ``--name`` (say, mlx-lm's ``num_draft_tokens``).
    ``args`` is the server's parsed command line, ``options`` what
    ``activate`` returned. Asked each time the page is built; a plugin that
    raises keeps its parsed values.
    """


@hookspec
def status_charts() -> Optional[List[Tuple[str, str, str]]]:
    """Return trends for the status page: ``[(title, numerator, denominator)]``.

    ``numerator`` and ``denominator`` are sample names of counters this
    plugin reports in ``metrics`` (e.g. ``"mlx_lm_spec_decode_accepted_total"``
    over ``"mlx_lm_spec_decode_drafted_total"``); the page draws their
    increase over each sampling interval as a ratio. An empty ``denominator``
    draws the numerator's rate per second instead.
    """


@hookspec
def add_subcommands(subparsers: Any) -> None:
    """Add subcommands to the ``mlx-lm-ext`` command.

    Each added parser must ``set_defaults(func=callable)``; the callable gets
    the parsed arguments and returns an exit status.
    """


@hookspec
def doctor() -> List[Tuple[str, str]]:
    """Return ``[(label, value), ...]`` lines for ``mlx-lm-ext doctor``."""
