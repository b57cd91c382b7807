"""One page builder per site: ``build(world, state, path) -> Page`` (see :mod:`confkv.eval.agent.env`)."""
