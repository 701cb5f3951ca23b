"""``lpcal simulate``: play synthetic, miscalibrated model traffic into Kafka.

Import each name from the module that defines it:

* :mod:`daemon.tools.simulate.model`: :class:`~daemon.tools.simulate.model.SyntheticModel`, a
  seeded overconfident classifier whose true conditional label distribution ``q`` is known
  (:func:`~daemon.tools.simulate.model.true_label_dist`); its true ``Err_p`` and Brier score are
  :func:`lpcal.metrics.err_p_true` and :func:`lpcal.metrics.brier_true`.
* :mod:`daemon.tools.simulate.traffic`: :class:`~daemon.tools.simulate.traffic.TrafficGenerator`,
  the interleaved prediction / outcome stream of several models (pure, seeded, no I/O).
* :mod:`daemon.tools.simulate.driver`: :func:`~daemon.tools.simulate.driver.simulate`, which
  produces a stream to Kafka at a given rate.
* :mod:`daemon.tools.simulate.cli`: ``lpcal simulate`` (also ``python -m daemon.tools.simulate``).

Usage::

    from daemon.tools.simulate.driver import simulate
    from daemon.tools.simulate.model import SyntheticModel
    from daemon.tools.simulate.traffic import TrafficGenerator
    from lpcal.metrics import err_p_true

    gen = TrafficGenerator([SyntheticModel("fraud-v3", k=3, T=0.3, scale=5.0, skew=0.0, seed=1)],
                           events=10_000, delay=5.0, orphan_frac=0.05)
    for topic_kind, key, value in gen:          # "predictions" | "outcomes", bytes, bytes
        ...
    f, q, y = SyntheticModel("m", 3, 0.3, 5.0, 0.0, seed=9).sample(100_000)
    print(err_p_true(f, q, lam=20, p=2.0), err_p_true(binmap.apply(f), q, 20, 2.0))

    report = asyncio.run(simulate("127.0.0.1:9092", {"predictions": "lpcal.predictions",
                                                     "outcomes": "lpcal.outcomes"}, gen,
                                  rate=1000, idempotence=False))
"""
