"""The OpenAI-compatible HTTP server of one frontend process.

Runs in an HTTP frontend process, on a uvloop event loop.
  ``main``            the process's flags and start-up (``conveyor frontend``, ``python -m conveyor.frontend``)
  ``runner``          uvicorn on a shared port, the SIGTERM drain, the ready file
  ``app``             routes, error handlers, attaching to the engine at start-up
  ``gate``            API key, the per-frontend in-flight cap, 503 while draining
  ``request_models``  request bodies (msgspec) and their checks -> ``SamplingParams``
  ``response_models`` response bodies and server-sent events
  ``completions``, ``chat``   the two generation endpoints
  ``responses``       OpenAI's Responses API, a view of chat (``responses_input``,
                      ``responses_stream``, ``responses_models``, ``responses_store``)
  ``messages``        Anthropic's Messages API, a view of chat (``messages_input``,
                      ``messages_stream``, ``messages_models``)
  ``serving``         what they share: state, the pipeline's errors as 400s, streaming helpers
  ``choice_stream``   one HTTP request's engine requests, merged into one delta stream
  ``logprobs``        engine logprob rows -> OpenAI's two formats
  ``metrics``         the Prometheus metrics a frontend records and publishes
  ``metrics_export``  a scrape: every frontend's files merged into the server's totals
  ``metrics_dir``     the folder a server's frontends share their metrics in
  ``request_log``     ``--enable-log-requests``: a line per request at arrival and at its end
  ``errors``          OpenAI-shaped error bodies (Anthropic-shaped on /v1/messages)
  ``operator_routes`` /ping, /invocations, /tokenizer_info, /v1/models/{model}, /load
  ``openapi``         the route table every route is registered from
"""
