// What a streamed response's events become on the wire (private to src/server). SseStream
// (sse_stream.h) moves the bytes; a renderer turns the engine's events of one request into
// server-sent events in the shape of the endpoint: chat and completion chunks (chat_stream.cpp)
// or the Responses API's typed events (responses_stream.cpp). A renderer is used under its
// stream's mutex, from whichever thread delivers the events.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megadecode/server/anthropic_api.h"
#include "megadecode/server/engine_loop.h"
#include "megadecode/server/request.h"
#include "megadecode/server/responses.h"
#include "megadecode/server/responses_api.h"
#include "megadecode/server/tool_calls.h"

namespace md::server {

// What the access log reports of a stream.
struct StreamTotals {
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  double first_token = 0;  // steady seconds of the first generated token (0: none yet)
};

class StreamRenderer {
 public:
  virtual ~StreamRenderer() = default;
  virtual std::string start() = 0;                // before any event
  virtual std::string event(ChoiceEvent& e) = 0;  // one engine event (may be empty text)
  virtual std::string end() = 0;                  // after the request's last event
  const StreamTotals& totals() const { return totals_; }

 protected:
  StreamTotals totals_;
};

// /v1/completions and /v1/chat/completions chunks: `data: {chunk}` lines, the usage chunk with
// include_usage, then `data: [DONE]`.
class ChatStreamRenderer : public StreamRenderer {
 public:
  ChatStreamRenderer(CompletionRequest req, ResponseMeta meta, const Tokenizer& tok,
                     size_t choices);
  std::string start() override;
  std::string event(ChoiceEvent& e) override;
  std::string end() override;

 private:
  // Choice i's template of a chunk that carries only text (ChunkTemplate), made at first use.
  const ChunkTemplate& plain_chunk(size_t i);

  const CompletionRequest req_;
  const ResponseMeta meta_;
  const Tokenizer& tok_;
  std::vector<size_t> text_offset_;    // completions logprobs: text sent so far per choice
  std::vector<ToolCallStream> tools_;  // chat with tools: each choice's tool-call parser
  std::vector<bool> echoed_;           // completions echo: the prompt text has been sent
  std::vector<ChunkTemplate> plain_;   // per choice (plain_chunk)
};

// The Responses API's typed events (responses_output.cpp): response.created and in_progress, the
// output items' events, then response.completed / incomplete / failed (no [DONE], as OpenAI's
// stream ends). With the request's `store`, the finished response goes into `store`.
std::unique_ptr<StreamRenderer> responses_stream_renderer(
    std::shared_ptr<const ResponsesRequest> req, ResponseMeta meta, const Tokenizer& tok,
    std::shared_ptr<ResponseStore> store);

// The Anthropic Messages API's events (anthropic_output.cpp): message_start, ping, the content
// blocks' events, message_delta, message_stop (or an error event).
std::unique_ptr<StreamRenderer> messages_stream_renderer(std::shared_ptr<const MessagesRequest> req,
                                                         ResponseMeta meta);

}  // namespace md::server
