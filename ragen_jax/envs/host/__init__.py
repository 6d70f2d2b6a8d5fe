"""Host environments: Python environments that are not pure JAX, played by the same rollout.

* ``env``: the ``HostEnv`` contract (``reset(seed)``, ``step(action)``) every host env meets;
* ``family``: ``HostEnvFamily``, one instance per episode slot behind the surface the rollout
  gives every env;
* ``processes``: the worker-process pool the instances live in (a hang is killed, a crash
  costs one episode);
* ``serve`` and ``remote``: any registered env served over HTTP, and the client env that
  plays one;
* ``code_sandbox`` and ``sandbox_child``: running model-written programs confined.
"""
