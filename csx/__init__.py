"""The ``csx`` command: its training subcommands and the service's, above both packages."""
