// cpbook: every figure of a chapter opens at full size on a tap or click.  Figures are drawn for
// the text column; on a phone they shrink to the screen's width and their labels with them, so
// each output image becomes a link to its own PNG (explorer panels, whose images are inline
// data, keep their controls instead).
document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll("div.cell_output img, figure img").forEach(function (img) {
    if (img.closest(".cpx") || img.src.startsWith("data:")) return;
    var link = img.closest("a");
    if (link) {  // a MyST {figure} with a width is already a link to its own image
      if (link.classList.contains("image-reference") && link.href === img.src) {
        link.classList.add("cpbook-zoom");
        link.title = "Open the figure at full size";
      }
      return;
    }
    var a = document.createElement("a");
    a.href = img.getAttribute("src");
    a.className = "cpbook-zoom";
    a.title = "Open the figure at full size";
    img.parentNode.insertBefore(a, img);
    a.appendChild(img);
  });
});
