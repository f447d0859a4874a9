"""Recordings on disk: replaying them as a teacher (:mod:`.replay`, :mod:`.multi_replay`),
reading them as a torch dataset (:mod:`.dataset`), and making them (:mod:`.record_cli`,
the ``teacher-record`` command: :mod:`.inputs` streams the corpus, :mod:`.recorder` runs
one shard, :mod:`.verify` checks a sharded recording)."""
