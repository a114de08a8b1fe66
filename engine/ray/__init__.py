"""`--distributed-executor-backend ray`: prefill and decode units as Ray actors on the nodes of a Ray cluster."""
