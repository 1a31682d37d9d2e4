"""The ``paramserve`` command and its subcommands (``ps``, ``worker``, ``demo``, ``launch``, ``health``)."""
