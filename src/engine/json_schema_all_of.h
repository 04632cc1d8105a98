// allOf for the JSON Schema compiler (json_schema.cpp): the subschemas merged into one schema
// before it is compiled, since the cursor follows one node per value.
#pragma once
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

namespace md::detail {

// v (a schema object with "allOf") as one schema: its own keywords and each element's (a $ref
// element: its target's, through `resolve`, which gives null for a reference that is not this
// schema's). Merging: properties joined (one defined twice: {"allOf": [both]}, merged when that
// member is compiled), required joined, additionalProperties false if any says so, type lists
// intersected, the tighter of each bound, enums intersected, items and the alternatives as for
// properties; annotations from the first that has them. An md::Error names the place of a
// conflict that cannot be merged (two patterns, two anyOf, an empty intersection) or of an allOf
// nested deeper than 8.
nlohmann::json merge_all_of(const nlohmann::json& v, const std::string& where,
                            const std::function<const nlohmann::json*(const std::string&)>& resolve,
                            int depth = 0);

}  // namespace md::detail
