"""``confkv serve --ray --replicas N``: the same app as a Ray Serve deployment (``pip install "ray[serve]"``).

Each replica loads the model and runs its own :class:`~confkv.serve.engine.Engine` (its own batch);
Ray Serve's proxy listens on ``--host:--port`` and its router spreads the requests over the replicas.
The protocol is the same (the replica's app is :func:`confkv.serve.app.create_app`), so are the
answers. ``/metrics`` and ``/health`` answer for the replica the request was routed to.
"""

from __future__ import annotations

from typing import Any, Callable


class ConfKVReplica:
    """One replica: a model, a :class:`~confkv.serve.app.Server` and its engine.

    ``loader``: a picklable callable returning ``(model, tokenizer)`` (default: ``load_model(model)``);
    ``settings``: the keyword arguments of :class:`~confkv.serve.app.Server`; ``threads``: torch threads.
    """

    def __init__(self, settings: dict[str, Any], loader: Callable[[], tuple[Any, Any]] | None = None,
                 model: str = "smollm2", dtype: str = "float32", threads: int | None = None) -> None:
        import torch

        from confkv.serve.app import Server

        if threads:
            torch.set_num_threads(threads)
        if loader is None:
            from confkv.models import load_model

            model_obj, tokenizer = load_model(model, dtype=getattr(torch, dtype))
        else:
            model_obj, tokenizer = loader()
        self.server = Server(model_obj, tokenizer, **settings)
        self.server.engine.start()

    def __serve_build_asgi_app__(self) -> Any:
        from confkv.serve.app import create_app

        return create_app(self.server)


def deployment(settings: dict[str, Any], *, replicas: int, loader: Callable | None = None, model: str = "smollm2",
               dtype: str = "float32", threads: int | None = None, num_cpus: float = 1.0) -> Any:
    """The bound Ray Serve application: ``replicas`` copies of :class:`ConfKVReplica`."""
    from ray import serve

    max_ongoing = settings.get("max_batch", 8) + settings.get("max_queue", 64) + 1
    cls = serve.deployment(num_replicas=replicas, max_ongoing_requests=max_ongoing,
                           ray_actor_options={"num_cpus": num_cpus},
                           graceful_shutdown_timeout_s=600)(serve.ingress()(ConfKVReplica))
    return cls.bind(settings, loader, model, dtype, threads)


def run(args: Any, settings: dict[str, Any]) -> int:
    """Start (or join, ``--ray-address``) Ray, run the deployment on ``--host:--port`` until interrupted."""
    try:
        import ray
        from ray import serve
    except ImportError:
        print('confkv serve --ray needs Ray Serve: pip install "ray[serve]==2.60.0"')
        return 2
    ray.init(address=args.ray_address, include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = deployment(settings, replicas=args.replicas, model=args.model, dtype=args.dtype, threads=args.threads,
                     num_cpus=args.replica_cpus)
    try:
        serve.run(app, name="confkv", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
    return 0


def tiny_llama(initializer_range: float = 0.2) -> tuple[Any, Any]:
    """A tiny random Llama and its byte tokenizer (the Ray Serve test's picklable loader)."""
    from confkv.models import tiny_model, tiny_tokenizer

    return tiny_model("llama", initializer_range=initializer_range), tiny_tokenizer()
