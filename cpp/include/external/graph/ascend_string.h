// ge::AscendString for llmdd: an immutable string usable as a std::map key, with the
// member functions of CANN's public AscendString. Header-only (no symbol to link).
#ifndef LLMDD_EXTERNAL_GRAPH_ASCEND_STRING_H_
#define LLMDD_EXTERNAL_GRAPH_ASCEND_STRING_H_

#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "types.h"

namespace ge {
class AscendString {
 public:
  AscendString() = default;
  ~AscendString() = default;
  AscendString(const char_t *const name)  // NOLINT: implicit, as upstream (options["k"] = "v")
      : text_(name == nullptr ? nullptr : std::make_shared<std::string>(name)) {}
  AscendString(const char_t *const name, size_t length)
      : text_(name == nullptr ? nullptr : std::make_shared<std::string>(name, length)) {}

  const char_t *GetString() const { return text_ == nullptr ? "" : text_->c_str(); }
  size_t GetLength() const { return text_ == nullptr ? 0U : text_->size(); }
  size_t Find(const AscendString &other) const {
    return View().find(other.View());
  }
  size_t Hash() const { return std::hash<std::string>()(View()); }

  bool operator<(const AscendString &d) const { return View() < d.View(); }
  bool operator>(const AscendString &d) const { return View() > d.View(); }
  bool operator<=(const AscendString &d) const { return View() <= d.View(); }
  bool operator>=(const AscendString &d) const { return View() >= d.View(); }
  bool operator==(const AscendString &d) const { return View() == d.View(); }
  bool operator!=(const AscendString &d) const { return View() != d.View(); }
  bool operator==(const char_t *const d) const { return View() == (d == nullptr ? "" : d); }
  bool operator!=(const char_t *const d) const { return !(*this == d); }

 private:
  std::string View() const { return text_ == nullptr ? std::string() : *text_; }
  std::shared_ptr<std::string> text_;
};
}  // namespace ge

namespace std {
template <>
struct hash<ge::AscendString> {
  size_t operator()(const ge::AscendString &s) const { return s.Hash(); }
};
}  // namespace std

#endif  // LLMDD_EXTERNAL_GRAPH_ASCEND_STRING_H_
