"""Prefill-decode disaggregation: prefill instances hand their KV cache to decode instances.

    client -> afd router --(same request, one room id)--> prefill instance P and decode instance D

1. D's rank reserves the pages the request needs (prompt + first token) before anything runs, and
   tells P's rank (found through P's bootstrap server, `room % P's ranks`) which pages to fill
   (KVDest). A full D holds requests back until pages free up.
2. P admits the request only then, prefills it (chunked, from its prefix cache), sends each chunk's
   full pages as soon as the chunk is done, samples the first token and sends the rest with the
   first token, its logprobs and the sampling state (KVDone); its pages go to its prefix cache.
3. D writes the pages into its pool (builtin backend; with Mooncake, P already wrote them into D's
   registered pool), and the request joins D's running batch as a decode, its pages in D's prefix
   cache. Tokens stream to the client from D only.

Either side fails the request (never the instance) when its peer does not answer within
--disaggregation-timeout, and tells the peer (KVFail) so that its pages are freed too.
"""
