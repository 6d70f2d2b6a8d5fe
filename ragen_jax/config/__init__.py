"""The run config: its schema (``schema``, with ``rollout.config`` and
``starpo.filtering``'s sections), the typed reading of values (``fields``), loading files,
overrides and run folders (``loading``, with ``legacy`` for older run folders), the derived
settings (``resolve``), the generated reference page (``reference``) and the summary a run
prints at its start (``summary``)."""
