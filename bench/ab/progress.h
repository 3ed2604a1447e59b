// The progress line of the benchmarks. On a terminal it is rewritten in place with
// '\r'; in a log file or a CI transcript carriage returns pile up into one unreadable
// line, so there each new unit of work (a cell) gets a line of its own instead.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <string>

namespace kvfuse::bench {

class Progress {
 public:
  explicit Progress(FILE* out) : out_(out), tty_(out != nullptr && isatty(fileno(out))) {}

  // `unit` names what the line is about (e.g. "cell 3/8"); off a terminal only its
  // first update is printed.
  void update(const std::string& unit, const std::string& text) {
    if (!out_) return;
    if (tty_) {
      std::fprintf(out_, "\r%s %s   ", unit.c_str(), text.c_str());
      open_ = true;
    } else if (unit != last_unit_) {
      std::fprintf(out_, "%s %s\n", unit.c_str(), text.c_str());
    }
    std::fflush(out_);
    last_unit_ = unit;
  }
  // Ends the line being rewritten, if any.
  void finish() {
    if (out_ && open_) std::fprintf(out_, "\n");
    open_ = false;
  }

 private:
  FILE* out_;
  bool tty_;
  bool open_ = false;
  std::string last_unit_;
};

}  // namespace kvfuse::bench
