"""``lpcal simulate`` (also ``python -m daemon.tools.simulate``): the command line of the
simulator.

``lpcal simulate --bootstrap HOST:PORT [--models fraud-v3,churn-v1:5] [--k 3] [--events N]
[--rate R] [--delay S] [--T 0.3] [--drift AT:logits=S] ... [--no-idempotence]`` (``--help``
lists every option; ``--drift``, repeated, is a drift schedule of
:class:`~daemon.tools.simulate.traffic.Drift` steps). Each run draws a random run id that is part
of every event id (``fraud-v3-<run>-123``), so a second run never repeats the first's ids (which
the daemon would count as duplicates); ``--events`` defaults to enough events for one bin map of
each model under the daemon's settings (:func:`default_events`); a progress line goes to stderr
every 2 s.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from daemon.tools.simulate.driver import simulate
from daemon.tools.simulate.model import SyntheticModel
from daemon.tools.simulate.traffic import (
    MALFORMED_KINDS,
    OUTCOMES,
    PREDICTIONS,
    Drift,
    TrafficGenerator,
    check_frac,
)
from lpcal.errors import InputError, LpcalError

__all__ = ["build_parser", "default_events", "events_for_binmap", "generator_from_args", "main"]

#: Safety margin of :func:`events_for_binmap`: every pool's expected count at the returned
#: number of events is this many standard deviations above its target.
_ROUTING_SIGMAS = 6.0


def events_for_binmap(model_settings: Sequence[Any], ks: Sequence[int], *,
                      keep: float = 1.0) -> int:
    """Events that give every model one bin map (one full epoch of pools) in the daemon.

    ``model_settings``: the daemon's merged settings of each model (``ModelSettings``); ``ks``
    their classes; ``keep``: share of events that become joined samples (no orphans, no
    malformed events: 1). An epoch takes ``warmup`` samples in arrival order, then routes the
    others by a hash of their id to the pools and the held-out share in proportion to their
    targets (:meth:`lpcal.pools.PoolLayout.route`), so it is full only when the slowest
    destination is: the count returned gives each destination an expected count
    ``_ROUTING_SIGMAS`` binomial standard deviations above its target, divided by the
    model's ``sample_rate`` and ``keep``. Events go to the models in turn, so the total is
    the largest per-model count times the number of models, rounded up to a thousand."""
    per_model = 0
    for ms, k in zip(model_settings, ks, strict=True):
        layout = ms.epoch_spec().layout(int(k))
        targets = [layout.targets[n] for n in layout.names] + (
            [layout.holdout] if layout.holdout else [])
        total = float(sum(targets))
        n = total
        while any(n * t / total - _ROUTING_SIGMAS * math.sqrt(n * t / total * (1 - t / total))
                  < t for t in targets):
            n *= 1.01
        need = (layout.warmup + n) / float(getattr(ms, "sample_rate", 1.0)) / keep
        per_model = max(per_model, math.ceil(need))
    return -(-per_model * len(ks) // 1000) * 1000


def _models_arg(text: str) -> list[tuple[str, int | None]]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, k = part.rpartition(":") if ":" in part else (part, "", "")
        if not name:
            raise argparse.ArgumentTypeError(f"--models: empty model name in {part!r}")
        try:
            out.append((name, int(k) if k else None))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--models: k of {name!r} must be an integer, "
                                             f"got {k!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("--models: at least one model name")
    return out


def _kinds_arg(text: str) -> list[str]:
    kinds = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in kinds if x not in MALFORMED_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"--malformed-kinds: unknown {bad or text!r}; known: "
                                         + ", ".join(MALFORMED_KINDS))
    return kinds


def _drift_arg(text: str) -> Drift:
    try:
        return Drift.parse(text)
    except InputError as e:
        raise argparse.ArgumentTypeError(f"--drift: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lpcal simulate",
        description="Play synthetic traffic of overconfident models into Kafka: predictions "
                    "f = softmax(z), z ~ N(0, scale^2) - skew*log(j+1), labels ~ "
                    "softmax(T log f), each outcome DELAY s of event time after its prediction.")
    g = ap.add_argument_group("Kafka")
    g.add_argument("--bootstrap", help="HOST:PORT[,...] (default: from --config, else "
                                       "localhost:9092)")
    g.add_argument("--config", help="daemon TOML config: bootstrap, topics, security, "
                                    "idempotence and partitions default to its [kafka] section")
    g.add_argument("--topic-prefix", default="", help="prepended to both topic names")
    g.add_argument("--predictions-topic", help="default lpcal.predictions")
    g.add_argument("--outcomes-topic", help="default lpcal.outcomes")
    g.add_argument("--partitions", type=int, help="partitions of created topics (default 1)")
    g.add_argument("--no-create-topics", action="store_true",
                   help="do not create missing topics")
    g.add_argument("--idempotence", action=argparse.BooleanOptionalAction, default=None,
                   help="idempotent producer (default on; use --no-idempotence with the "
                        "embedded broker)")
    m = ap.add_argument_group("traffic")
    m.add_argument("--models", type=_models_arg, default=_models_arg("fraud-v3"),
                   help="comma-separated model ids, each optionally NAME:K (default fraud-v3)")
    m.add_argument("--k", type=int, default=3, help="classes of models without :K (default 3)")
    m.add_argument("--events", type=int, default=None,
                   help="events to generate, each 1-2 messages (default: enough for one bin map "
                        "of every model under the daemon settings `lpcal serve` reads here: "
                        "--config, else $LPCAL_CONFIG or config/lpcal.toml, and LPCAL_*; "
                        "printed at the start)")
    m.add_argument("--rate", type=float, default=0.0,
                   help="events per second of wall time; 0 = as fast as possible (default)")
    m.add_argument("--event-rate", type=float, default=None,
                   help="events per second of EVENT time (default: --rate, or 1000 if 0)")
    m.add_argument("--start", type=float, default=None,
                   help="event time (Unix s) of the first event (default: now)")
    m.add_argument("--delay", type=float, default=5.0,
                   help="seconds of event time from a prediction to its outcome (default 5)")
    m.add_argument("--jitter", type=float, default=0.5,
                   help="delay jitter: delay * (1 + jitter * U(-1, 1)), in [0, 1) (default 0.5)")
    m.add_argument("--T", type=float, default=0.3, help="true q = softmax(T log f); T < 1 is "
                                                        "overconfident (default 0.3)")
    m.add_argument("--scale", type=float, default=5.0, help="logit scale (default 5)")
    m.add_argument("--skew", type=float, default=0.0, help="logit skew (default 0)")
    m.add_argument("--orphan-frac", type=float, default=0.0,
                   help="fraction of predictions whose outcome never arrives")
    m.add_argument("--sample-frac", type=float, default=0.0,
                   help="fraction of complete samples (probs and label in one event)")
    m.add_argument("--logits-frac", type=float, default=0.0,
                   help="fraction of vectors sent as logits instead of probs")
    m.add_argument("--malformed-frac", type=float, default=0.0,
                   help="fraction of malformed events (dead-letter demo)")
    m.add_argument("--malformed-kinds", type=_kinds_arg, default=None,
                   help="comma-separated subset of " + ",".join(MALFORMED_KINDS) + " (default all)")
    m.add_argument("--drift-after", type=int, default=None,
                   help="after this many events switch every model's T to --drift-T")
    m.add_argument("--drift-T", type=float, default=None)
    m.add_argument("--drift", type=_drift_arg, action="append", default=[], metavar="SPEC",
                   help="a step of the drift schedule, repeatable: AT:logits=S[,T=T2]"
                        "[,model=NAME]: from event AT on (all models interleaved), the logits "
                        "of NAME (default every model) are multiplied by S (the truth stays: "
                        "0.5 under-confident, 2 over-confident) and its labels follow T2; e.g. "
                        "--drift 30000:logits=0.5")
    m.add_argument("--decimals", type=int, default=None,
                   help="round probabilities to this many decimals (default: full precision)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--run-id", default=None,
                   help="part of every event id (MODEL-RUN-N), so that runs never repeat an "
                        "id (default: 8 random hex digits per run; '' for MODEL-N)")
    m.add_argument("--quiet", action="store_true", help="no progress lines")
    return ap


def _resolve(a: argparse.Namespace) -> dict[str, Any]:
    """Kafka options: explicit flags > --config's [kafka] section > built-in defaults."""
    kafka = None
    if a.config:
        from daemon.settings import SettingsError, load_settings

        try:
            kafka = load_settings(a.config).kafka
        except SettingsError as e:
            raise InputError(f"--config {a.config}: {e}") from None
    topics = kafka.topics if kafka is not None else None
    preds = a.predictions_topic or (topics.predictions if topics else "lpcal.predictions")
    outs = a.outcomes_topic or (topics.outcomes if topics else "lpcal.outcomes")
    idem = a.idempotence if a.idempotence is not None else (
        kafka.enable_idempotence if kafka is not None else True)
    parts = a.partitions if a.partitions is not None else (
        kafka.topic_partitions if kafka is not None else 1)
    if parts < 1:
        raise InputError(f"--partitions must be >= 1, got {parts}")
    return {
        "bootstrap": a.bootstrap or (kafka.bootstrap_servers if kafka else "localhost:9092"),
        "topics": {PREDICTIONS: a.topic_prefix + preds, OUTCOMES: a.topic_prefix + outs},
        "idempotence": bool(idem), "partitions": int(parts), "security": kafka,
    }


def default_events(a: argparse.Namespace) -> tuple[int, str]:
    """``--events`` when it is not given, and where the settings it was sized for came from:
    :func:`events_for_binmap` of the models under the daemon settings ``lpcal serve`` would
    read here (``--config``, else ``$LPCAL_CONFIG`` or ``config/lpcal.toml``, and the
    ``LPCAL_*`` environment), or under the built-in defaults when those cannot be read."""
    from daemon.settings import ModelSettings, SettingsError, load_settings

    for name in ("orphan_frac", "sample_frac", "malformed_frac"):  # the generator's messages
        check_frac(name, getattr(a, name))
    try:
        settings = load_settings(a.config)
    except SettingsError as e:
        if a.config:
            raise InputError(f"--config {a.config}: {e}") from None
        settings = None
    if settings is None:
        where = "the built-in daemon defaults (the settings here do not load)"
        per_model = [ModelSettings() for _ in a.models]
    else:
        source = a.config or os.environ.get("LPCAL_CONFIG") or (
            "config/lpcal.toml" if Path("config/lpcal.toml").is_file() else None)
        where = (f"the daemon settings of {source}" if source
                 else "the built-in daemon defaults")
        per_model = [settings.model_settings(name) or settings.defaults for name, _ in a.models]
    keep = 1.0 - a.malformed_frac - a.orphan_frac * (1.0 - a.malformed_frac - a.sample_frac)
    if not keep > 0:
        raise InputError("--events is required when no event becomes a joined sample "
                         "(--orphan-frac / --malformed-frac)")
    ks = [k if k is not None else a.k for _, k in a.models]
    return events_for_binmap(per_model, ks, keep=keep), where


def generator_from_args(a: argparse.Namespace) -> TrafficGenerator:
    """The :class:`TrafficGenerator` the CLI arguments describe (model ``i`` gets seed
    ``[seed, i]``; ``--events`` unset: :func:`default_events`; ``--run-id`` unset: ids
    without a run part, :func:`main` draws a random one per run)."""
    models = [SyntheticModel(name, k if k is not None else a.k, a.T, a.scale, a.skew,
                             seed=[a.seed, i]) for i, (name, k) in enumerate(a.models)]
    if a.rate < 0 or not math.isfinite(a.rate):
        raise InputError(f"--rate must be >= 0, got {a.rate}")
    if a.events is None:
        a.events = default_events(a)[0]
    event_rate = a.event_rate if a.event_rate is not None else (a.rate if a.rate > 0 else 1000.0)
    return TrafficGenerator(
        models, a.events, event_rate=event_rate,
        start=a.start if a.start is not None else time.time(), delay=a.delay, jitter=a.jitter,
        orphan_frac=a.orphan_frac, sample_frac=a.sample_frac, logits_frac=a.logits_frac,
        malformed_frac=a.malformed_frac, malformed_kinds=a.malformed_kinds,
        drift_after=a.drift_after, drift_T=a.drift_T, drifts=getattr(a, "drift", ()),
        seed=a.seed, decimals=a.decimals,
        run_id=getattr(a, "run_id", None))


def main(argv: list[str] | None = None) -> int:
    """``lpcal simulate ARGS``; exit codes: 0 done, 2 bad arguments, 1 Kafka or other errors,
    130 interrupted."""
    try:
        a = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return int(e.code or 0)
    if a.run_id is None:  # every run its own ids: a second run never repeats the first's
        a.run_id = secrets.token_hex(4)
    sized = None
    try:
        if a.events is None:
            a.events, sized = default_events(a)
        gen = generator_from_args(a)
        kw = _resolve(a)
    except LpcalError as e:
        print(f"lpcal simulate: error: {e}", file=sys.stderr)
        return 2
    say = None if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    if say:
        ids = f"{gen.models[0].model_id}-{a.run_id}-0, ..." if a.run_id else "MODEL-N"
        say(f"simulate: {len(gen.models)} model(s) "
            f"{', '.join(f'{m.model_id} (k={m.k})' for m in gen.models)}, {gen.events} events"
            + (f" (enough for one bin map of each model under {sized})" if sized else "")
            + f", ids {ids} -> {kw['bootstrap']} {kw['topics'][PREDICTIONS]} / "
            f"{kw['topics'][OUTCOMES]}")
        for d in gen.drifts:
            say(f"simulate: drift {d.describe()}")
    from aiokafka.errors import KafkaError

    from daemon.kafka.clients import BrokerSettingsError
    from daemon.kafka.topics import TopicLayoutError

    try:
        report = asyncio.run(simulate(
            kw["bootstrap"], kw["topics"], gen, rate=a.rate, idempotence=kw["idempotence"],
            partitions=kw["partitions"], create_topics=not a.no_create_topics,
            security=kw["security"], progress=say))
    except KeyboardInterrupt:
        print(f"lpcal simulate: interrupted after {gen.produced} events", file=sys.stderr)
        return 130
    except LpcalError as e:
        print(f"lpcal simulate: error: {e}", file=sys.stderr)
        return 2
    except BrokerSettingsError as e:
        print(f"lpcal simulate: error: {e}", file=sys.stderr)
        return 1
    except (KafkaError, TopicLayoutError, OSError, TimeoutError) as e:
        print(f"lpcal simulate: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(report.summary())
    return 0

