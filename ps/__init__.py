"""The parameter servers, in four parts with walls between them: ``spec/`` (what a workload
declares and what client and server agree on), ``client/`` (the trainers' side), ``server/`` (a
server and its shard) and ``leader/`` (what ps0 does besides)."""
