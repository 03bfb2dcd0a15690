"""Data-plane transports of weight-sync: move the buckets of a bucket plan from trainer ranks
(senders) to engine workers (receivers).

`base` holds the interface (`TransportSpec`, `BucketSink`, `BucketSource`, `TransportError`)
and the one table `TRANSPORTS` that maps a transport name to its classes; `open_sink` and
`open_source` build them. The backends live in their own modules and are imported only when a
spec names them, so importing this package never imports Mooncake or sets up a process group.
"""
