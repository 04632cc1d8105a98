// Kimi K3 chat format (TemplateKind::kKimiK3), the half of chat_template.cpp that lives in
// chat_template_k3.cpp. Private to src/tokenizer.
#pragma once
#include <string>
#include <vector>

#include "megadecode/tokenizer/chat_template.h"

namespace md::k3 {

// The conversation as Kimi K3's encoder (encoding_k3.py build_chat_segments) segments it.
std::vector<ChatSegment> render(const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt,
                                const std::vector<nlohmann::json>& tools,
                                const ChatOptions& options);

// True for a template that is evidently of the K3 XTML family (its structure tokens and channels).
bool template_family(const std::string& jinja_source);

}  // namespace md::k3
